"""The client's dependencies (see pyproject.toml): kimi-vision-common is the folder next to this
file, named by its absolute path so that ``pip install ./client`` finds it without an index."""

from pathlib import Path

from setuptools import setup

COMMON = Path(__file__).resolve().parent / "common"

setup(
    install_requires=[
        f"kimi-vision-common @ {COMMON.as_uri()}",
        "numpy>=1.26",
        "tritonclient[http,grpc]>=2.41",
        # tritonclient.http's own event loop: its calls are bounded by gevent timeouts (transport/adapters.py).
        "gevent",
        "tqdm",
        # Image sizes for shared-memory regions and the generated sample images; any Pillow.
        "pillow",
    ]
)
