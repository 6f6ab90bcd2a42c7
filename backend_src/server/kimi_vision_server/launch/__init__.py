"""Starting tritonserver: one start path (``launcher.launch``) for ``kimi-prep serve`` (``serve``) and
``EmbeddedServer`` (``embedded``), its command line (``command``), its process life (``process``),
the admin key (``access``) and its shared-memory regions. Imports the package root, ``render`` (it
renders a repository) and ``watch`` (it starts the watchdog and the probes); never ``models``.
"""
