"""The CLI layer: the server's ``kimi-prep`` subcommands (:mod:`.commands`) and the in-process
benchmark behind ``kimi-prep bench-local`` (:mod:`.bench_local`). It sits above the serving
modules and may use the client's front; nothing below imports it."""
