"""Talking to one server: tritonclient's HTTP and gRPC clients behind one adapter
(:mod:`.adapters`), one deadline a call (:mod:`.deadline`) and a server's errors as the library's
classes (:mod:`.server_errors`). Imports only ``kimi_vision_common`` and tritonclient: nothing else of
the client."""
