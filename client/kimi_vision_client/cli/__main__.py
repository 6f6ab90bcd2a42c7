"""``python -m kimi_vision_client.cli``: ``kimi-prep``."""

import sys

from .front import main

sys.exit(main())
