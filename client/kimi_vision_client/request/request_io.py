"""One request of :class:`~kimi_vision_client.client.KimiVisionClient`: what it sends, and where
its answer lands.

A request is K encoded images (``IMAGE_BYTES [1, K]``) or a video chunk's K frames
(``FRAME_BYTES [1, K]``). It travels over the wire, or through one shared-memory slot (the input at
offset 0, the outputs after it), whose size is known before sending: the NaViT rule needs only each
image's width and height from its header. A request whose headers cannot be read (the server will
refuse it) sends its input through the slot and gets its (error) answer over the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.utils
import tritonclient.utils.shared_memory as shm

from kimi_vision_common.wire import FRAME_BYTES

from ..transport.deadline import Deadline
from .outputs import OUTPUT_DTYPES, chunk_output_byte_sizes, image_size, output_byte_sizes
from .shm_slots import SharedMemoryPool, ShmSlot
from .wire import Wire


@dataclass
class Request:
    """What a request sends, kept to send it again to another replica."""

    items: list[bytes]
    model: str
    input_name: str
    attempt: int = 1

    @property
    def single(self) -> bool:
        """One image, or one chunk: the server's ``image 0:`` is dropped from its error."""
        return len(self.items) == 1 or self.input_name == FRAME_BYTES

    def again(self) -> Request:
        """The same request, its next attempt."""
        return Request(self.items, self.model, self.input_name, self.attempt + 1)


def output_sizes(request: Request, wire: Wire) -> dict[str, int] | None:
    """Each output's bytes, from the images' headers; None where a header is not readable."""
    if request.input_name == FRAME_BYTES:
        first = image_size(request.items[0])
        return chunk_output_byte_sizes(len(request.items), first, wire.preset, wire.pixel_output) if first else None
    sizes = [image_size(data) for data in request.items]
    if None in sizes:
        return None
    return output_byte_sizes(sizes, wire.preset, wire.pixel_output)  # type: ignore[arg-type]


def built(
    module: Any, request: Request, wire: Wire, *, pool: SharedMemoryPool, client: Any, deadline: Deadline
) -> tuple[list[Any], list[Any], ShmSlot | None, dict[str, int] | None]:
    """``request``'s InferInput / InferRequestedOutput lists (tritonclient ``module``'s), the
    shared-memory slot it travels in (None: the wire) and its outputs' offsets there."""
    image = module.InferInput(request.input_name, [1, len(request.items)], "BYTES")
    batch = np.array([request.items], dtype=np.object_)
    outputs = [module.InferRequestedOutput(name) for name in wire.outputs]
    if not pool.usable:
        image.set_data_from_numpy(batch)
        return [image], outputs, None, None
    serialized = tritonclient.utils.serialize_byte_tensor(batch)
    input_bytes = tritonclient.utils.serialized_byte_size(serialized)
    sizes = output_sizes(request, wire)
    slot = pool.slot_for(client, input_bytes, sum(sizes.values()) if sizes else 0, deadline)
    if slot is None or slot.region is None:
        image.set_data_from_numpy(batch)
        return [image], outputs, None, None
    shm.set_shared_memory_region(slot.region.handle, [serialized])
    image.set_shared_memory(slot.region.name, input_bytes)
    if sizes is None:
        return [image], outputs, slot, None
    offsets: dict[str, int] = {}
    offset = slot.output_offset
    for output, (name, byte_size) in zip(outputs, sizes.items(), strict=True):
        output.set_shared_memory(slot.region.name, byte_size, offset)
        offsets[name] = offset
        offset += byte_size
    return [image], outputs, slot, offsets


def shm_outputs(adapter: Any, result: Any, slot: ShmSlot, offsets: dict[str, int]) -> dict[str, np.ndarray]:
    """The outputs of ``result`` as views of ``slot``'s region (copy before the slot is reused)."""
    assert slot.region is not None
    return {
        name: shm.get_contents_as_numpy(
            slot.region.handle, OUTPUT_DTYPES[name], adapter.output_shape(result, name), offset
        )
        for name, offset in offsets.items()
    }
