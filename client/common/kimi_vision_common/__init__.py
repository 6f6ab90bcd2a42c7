"""What the library, the server and the client share: presets as data, the NaViT size rule, the
error types and the wire's names and tags, the result types, and the uint8 wire's expansion.

Pure Python and numpy (1 or 2): installing it pulls nothing else.
"""
