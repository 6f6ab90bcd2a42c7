"""One server or several: a channel each and how requests spread (:mod:`.replicas`), whether one
serves a model (:mod:`.readiness`), a request sent, sent again elsewhere and its answer collected
(:mod:`.resends`). May import :mod:`..transport`, :mod:`..request` and ``kimi_vision_common``; not the
processors or the CLI."""
