"""The expert streaming subsystem. Code outside this folder uses `provider.py` (and the packer,
which writes the format, uses `format.py`)."""
