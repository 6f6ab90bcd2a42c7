"""What the remote processor (:mod:`kimi_vision_client.remote_processor`) is built from and built
into: what travels for an image or a chunk's frames (:mod:`.encoding`), a client per thread
(:mod:`.thread_clients`), the class the vLLM plugin has vLLM build (:mod:`.vllm_processor`). May
import the client's fronts (:mod:`kimi_vision_client.client`, :mod:`kimi_vision_client.remote_processor`)
and the folders below them; not the CLI."""
