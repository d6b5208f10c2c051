"""The prefix store: the memory tier, the disk tier and its files, K/V quantization."""
