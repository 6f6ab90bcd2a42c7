"""Client side of kimi-vision-prep: Triton client, CLI (``kimi-prep``) and benchmarks."""
