"""``LLM(load_format="dummy")`` generates from a chat with an image, end to end in vLLM's engine
(multiprocess: the engine core in its own process, as served), and prints what ran as JSON.

    python generate.py CHECKPOINT IMAGE
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(checkpoint: Path, image: Path) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(checkpoint),
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=8192,
        kv_cache_memory_bytes=256 << 20,  # vLLM's CPU backend otherwise wants 92% of the host's memory free
        limit_mm_per_prompt={"vision_chunk": 1},
    )
    url = "data:image/jpeg;base64," + base64.b64encode(image.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe this"}]
    messages = [{"role": "user", "content": content}]
    outputs = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))
    processor = llm.llm_engine.renderer.get_mm_processor().info.image_processor
    kind = type(processor)
    print(
        json.dumps(
            {
                "processor": f"{kind.__module__}.{kind.__qualname__}",
                "prompt_token_ids": list(outputs[0].prompt_token_ids),
                "generated_token_ids": list(outputs[0].outputs[0].token_ids),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
