"""Pieces of ``config.pbtxt`` text: comments, tensors, parameters, a model's head."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def comment(text: str) -> str:
    """``text`` as ``#`` comment lines."""
    return "".join(f"# {line}\n" if line else "#\n" for line in text.strip().splitlines())


def tensor(name: str, data_type: str, dims: Iterable[int], extra: str = "") -> str:
    """One ``{ name: ... data_type: ... dims: [...] }`` entry (``extra``: e.g. allow_ragged_batch)."""
    dims_text = ", ".join(str(d) for d in dims)
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims_text} ]{" " + extra if extra else ""} }}'


def tensor_list(key: str, entries: Iterable[tuple[str, str]]) -> str:
    """``input [...]`` / ``output [...]`` from ``(comment, tensor)`` pairs (empty comment: none)."""
    lines = []
    entries = list(entries)
    for index, (note, text) in enumerate(entries):
        lines.extend(f"  # {line}" for line in note.splitlines())
        lines.append(f"  {text}{',' if index < len(entries) - 1 else ''}")
    return f"{key} [\n" + "\n".join(lines) + "\n]\n"


def quoted(value: object) -> str:
    """A pbtxt string literal's contents."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def parameters(values: Mapping[str, object], note: str = "") -> str:
    """``parameters`` entries (string values), after the comment ``note`` if any."""
    lines = "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{quoted(v)}" }} }}\n' for k, v in values.items()
    )
    return (comment(note) if note else "") + lines


def head(name: str, summary: str, max_batch_size: int, backend: str = "python") -> str:
    """The summary comment, ``name``, the backend (``"ensemble"``: the ensemble platform) and ``max_batch_size``."""
    kind = 'platform: "ensemble"' if backend == "ensemble" else f'backend: "{backend}"'
    return comment(summary) + f'name: "{name}"\n{kind}\nmax_batch_size: {max_batch_size}\n'
