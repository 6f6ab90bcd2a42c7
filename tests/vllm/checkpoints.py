"""Tiny local Kimi checkpoint folders, enough for vLLM to build its multimodal processors and to
run ``LLM(load_format="dummy")`` offline: a ``config.json`` of the real model type with small text
and vision dimensions, the preset's ``preprocessor_config.json`` (``media_proc_cfg``) and a
``tokenizer.json`` made with ``tokenizers`` that holds the media tokens (ids as the real
checkpoints': ``<|media_pad|>`` is 163605)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kimi_vision_common.presets import get_preset, media_proc_cfg

MEDIA_PAD_ID = 163605
VOCAB_SIZE = 163840
MAX_POSITIONS = 32768  # room for the largest K3 image (16,384 tokens) and a prompt
# The real checkpoints' ids for the tokens the prompts use (the rest of the vocabulary is filler).
SPECIAL_TOKENS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": MEDIA_PAD_ID,
    "<|kimi_image_placeholder|>": 163606,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_end|>": 163586,
    "<|kimi_k25_video_placeholder|>": 163607,
}
WORDS = ["image", "video", "describe", "this", "what", "is", "in", "the", "picture", "a", "of", "and", "x", "user"]
# A template vLLM treats as the "string" content format: each message's text, its media
# placeholders already merged into it by vLLM.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>{% else %}<|im_assistant|>{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)
MODELS = {"kimi-k2.5": "kimi_k25", "kimi-k3": "kimi_k3"}


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    digits = {str(d): len(WORDS) + 1 + d for d in range(10)}
    vocab.update(digits)
    vocab.update({":": len(vocab), ".": len(vocab) + 1})
    vocab.update(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation()]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = TemplateProcessing(single="$A", special_tokens=[])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "unk_token": "[UNK]",
                "model_max_length": MAX_POSITIONS,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def _k25_config() -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "use_unified_vision_chunk": True,
        "image_token_id": MEDIA_PAD_ID,
        "media_placeholder_token_id": MEDIA_PAD_ID,
        "projection_hidden_size": 64,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "deepseek_v3",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "max_position_embeddings": MAX_POSITIONS,
            "bos_token_id": SPECIAL_TOKENS["[BOS]"],
            "eos_token_id": SPECIAL_TOKENS["[EOS]"],
            "torch_dtype": "bfloat16",
        },
        "vision_config": {
            "patch_size": 14,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "merge_kernel_size": [2, 2],
        },
    }


def _k3_config() -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "media_placeholder_token_id": MEDIA_PAD_ID,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "text_config": {
            "model_type": "kimi_linear",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": MAX_POSITIONS,
            "bos_token_id": SPECIAL_TOKENS["[BOS]"],
            "eos_token_id": SPECIAL_TOKENS["[EOS]"],
        },
        "vision_config": {
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
            "vt_hidden_size": 64,
            "vt_intermediate_size": 128,
            "text_hidden_size": 64,
        },
    }


def write_checkpoint(folder: Path, preset: str) -> Path:
    """``folder`` filled with a tiny checkpoint of ``preset`` ("kimi-k2.5" or "kimi-k3")."""
    folder.mkdir(parents=True, exist_ok=True)
    config = _k25_config() if preset == "kimi-k2.5" else _k3_config()
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    processor_class = "KimiK25VisionProcessor" if preset == "kimi-k2.5" else "KimiK3VisionProcessor"
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoImageProcessor": f"{MODELS[preset]}_vision_processing.{processor_class}"},
                "media_proc_cfg": media_proc_cfg(get_preset(preset)),
            },
            indent=1,
        )
    )
    _tokenizer(folder)
    return folder


def vllm_environment(setting: str | None = None) -> dict[str, str]:
    """The environment of a vLLM process run offline on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``:
    vLLM's CUDA wheel on a host without a GPU infers no device otherwise; vLLM's CPU build is on it
    anyway), the plugin's setting ``KIMI_PREP_VLLM`` as given: None (unset: ours in process),
    ``"off"`` (vLLM's own Kimi processing) or a server's address."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("KIMI_PREP_VLLM", None)
    if setting is not None:
        env["KIMI_PREP_VLLM"] = setting
    return env
