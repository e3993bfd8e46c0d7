"""test_ranks.py on several GPUs (NCCL for the data, gloo for control): the same greedy tokens as one GPU, resident
and with a quarter pool and the host tier per GPU. Skipped on a machine with fewer than 2 GPUs."""

import pytest
import torch

from moestream.engine.llm import LLM
from tests.engine.test_batching import GREEDY, _prompts, _quarter_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("setting", ["resident", "quarter"])
def test_gpus_give_the_tokens_of_one_gpu(tiny, gpus, setting):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    store = tiny.store("qwen3_moe")
    options = _quarter_pool(store) if setting == "quarter" else {}
    outputs = []
    for n in (1, gpus):
        llm = LLM(store, device="cuda", gpus=n, **options)
        try:
            outputs.append([o.token_ids for o in llm.generate(_prompts(llm), GREEDY)])
        finally:
            llm.close()
            torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]
