"""What the library, the server and the client share: presets as data, the NaViT size rule, the
error types and the wire's names and tags, the result types, and the uint8 wire's expansion.

Pure Python and numpy (1 or 2): installing it pulls nothing else.

Two folders plug this project into an engine: :mod:`.vllm_plugin` (vLLM's ``vllm.general_plugins``
entry point) and :mod:`.sglang_processors` (SGLang's external processor package). They may import
the modules here (the address grammar both read: :mod:`.remote_setting`); no module here, and
neither of them, imports the other folder.
"""
