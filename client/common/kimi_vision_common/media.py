"""Telling a video from an image by its first bytes, without decoding either.

A client routes a file to a video or an image model by content (whatever its name says); the
server then decodes it and gives the verdict. Image formats that share a container (HEIF/AVIF in
ISO-BMFF, WebP in RIFF) are told apart by their brand.
"""

from __future__ import annotations

# ISO-BMFF brands of still images (HEIF, AVIF): an ``ftyp`` box that is not a video.
IMAGE_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})
MPEG_TS_PACKET = 188


def looks_like_video(data: bytes) -> bool:
    """Whether ``data`` starts like a video container: MP4/MOV/3GP (ISO-BMFF ``ftyp`` with a video
    brand), Matroska/WebM, AVI, FLV, MPEG program or transport stream."""
    head = bytes(data[:16])
    if head[4:8] == b"ftyp":
        return head[8:12] not in IMAGE_BRANDS
    if head[4:8] in (b"moov", b"mdat", b"wide", b"free"):  # QuickTime without ftyp
        return True
    if head.startswith((b"\x1a\x45\xdf\xa3", b"FLV\x01", b"\x00\x00\x01\xba")):
        return True
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return True
    # MPEG-TS: a sync byte 0x47 at the start of three consecutive 188-byte packets.
    return len(data) > 2 * MPEG_TS_PACKET and all(data[i * MPEG_TS_PACKET] == 0x47 for i in range(3))
