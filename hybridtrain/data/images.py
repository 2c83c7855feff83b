"""Decoded images to 8-bit RGB without losing what the file says: the one conversion of every PIL reader.

PIL's own ``convert("RGB")`` is faithful for 8-bit modes, but not for all: a 16-bit greyscale PNG (``I;16``) is
clipped at 255, so a full-range image reaches the model as a handful of grey levels, and the alpha of a palette or
RGBA image is dropped, showing whatever colour the transparent pixels happen to hold. Here:

- 16-bit and 32-bit integer greyscale (``I;16*``, ``I``) are scaled from 0..65535 to 0..255;
- transparency (an alpha channel, or a palette's or colour key's ``transparency``) is composited over
  :data:`BACKGROUND`, the ImageNet mean colour, so a transparent pixel normalises to about zero;
- CMYK is converted through the file's own ICC profile when it carries one, else by the standard formula
  ``R = 255 (1 - C) (1 - K)`` (PIL's);
- floating-point pixels (``F``) have no agreed scale, and are refused by :class:`UnsupportedImage` naming the
  file and the fix.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

BACKGROUND = (124, 116, 104)  # the ImageNet mean (0.485, 0.456, 0.406) x 255: transparent -> about 0 after normalising
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class UnsupportedImage(ValueError):
    """An image whose pixels cannot become 8-bit RGB without guessing; the message names the fix."""


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB, converted faithfully (see the module's doc), or :class:`UnsupportedImage`. The
    pixels are decoded here, so a truncated or corrupt file fails here, whatever its mode."""
    img.load()
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I;16") or mode == "I":
        values = np.asarray(img).astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise UnsupportedImage(f"its {mode} pixels run from {values.min()} to {values.max()}, beyond "
                                   f"16 bits: convert it to an 8-bit image (e.g. PNG or JPEG) and retry")
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        raise UnsupportedImage("its pixels are floating-point numbers (mode F), which have no agreed 8-bit "
                               "scale: convert it to an 8-bit image (e.g. PNG or JPEG) and retry")
    if mode == "CMYK":
        return _cmyk_to_rgb(img)
    if mode in ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    profile = img.info.get("icc_profile")
    if profile:
        from PIL import ImageCms
        try:
            return ImageCms.profileToProfile(img, ImageCms.ImageCmsProfile(io.BytesIO(profile)),
                                             ImageCms.createProfile("sRGB"), outputMode="RGB")
        except (ImageCms.PyCMSError, OSError, ValueError):
            pass  # a damaged profile: the formula below, as without one
    return img.convert("RGB")


def decode_error(path: str) -> str | None:
    """None when the image decodes completely, else the decoder's complaint."""
    try:
        with Image.open(path) as img:
            to_rgb(img)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return f"{type(exc).__name__}: {exc}"
    return None
