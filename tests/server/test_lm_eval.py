"""lm-evaluation-harness's `local-completions` against the server on the demo model: a loglikelihood task (the
offline docs_mc set, its first LIMIT documents here) scores the same through the server as through the engine
directly."""

import json
import os

import pytest

from benchmarks.loglikelihood import score
from moestream.cli.demo import DEMO_STORE
from tests.server.conftest import MODEL

lm_eval = pytest.importorskip("lm_eval")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(ROOT, "benchmarks", "lm_eval")
LIMIT = 8  # of 33 documents (lm-eval through the server costs ~4 s a document on a 2-core CPU)


def test_lm_eval_scores_the_same_through_the_server(serve, reference, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task names its data file from the repository root
    server = serve(DEMO_STORE)
    results = simple_evaluate(
        model="local-completions", tasks=["docs_mc"], task_manager=TaskManager(include_path=TASKS), limit=LIMIT,
        model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={DEMO_STORE},"
                   "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")
    through_server = results["results"]["docs_mc"]
    with open(os.path.join(TASKS, "docs_mc.jsonl")) as f:
        direct = score(reference(DEMO_STORE), [json.loads(line) for line in f][:LIMIT])
    assert through_server["acc,none"] == direct["acc"] and through_server["acc_norm,none"] == direct["acc_norm"]
    assert direct["acc"] > 0.25  # the demo model knows its docs better than chance
