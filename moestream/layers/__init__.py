"""Model building blocks in plain PyTorch: norms, rotary, attention, Gated DeltaNet, MLP, MoE."""
