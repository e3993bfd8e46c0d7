"""The expert streaming subsystem. From outside this folder: the engine uses `provider.py` (the seam the
MoE layers call), `store.py` (opening a store) and `ngram.py` (PLE rows); the packer and the kernels
read the store spec in `format.py`, and the kernels the parts the provider hands them (`grouping.py`). Everything
else here is internal."""
