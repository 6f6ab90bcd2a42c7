"""A request's data: the wire and preset a model answers on (:mod:`.wire`), what one request sends
and where its answer lands (:mod:`.request_io`, :mod:`.shm_slots`), its outputs as results
(:mod:`.outputs`), video streams and token counts (:mod:`.media`). May import :mod:`..transport`
and ``kimi_vision_common``; not the servers, the processors or the CLI."""
