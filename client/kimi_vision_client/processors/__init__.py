"""What the remote processor (:mod:`kimi_vision_client.remote_processor`) is built from and built
into: a client per thread (:mod:`.thread_clients`), the class the vLLM plugin has vLLM build
(:mod:`.vllm_processor`). May import the client's front (:mod:`kimi_vision_client.client`,
:mod:`kimi_vision_client.remote_processor`) and the folders below it; not the CLI."""
