"""Plain float formats F32, F16 and BF16 (block size 1): bytes are the little-endian values.

BF16 is rounded to nearest even, as gguf-py's and llama.cpp's ``fp32_to_bf16`` do.
"""

from __future__ import annotations

import torch

from dynaquant.quant.codecs.base import Codec, register


class _FloatCodec(Codec):
    dtype: torch.dtype

    def encode_blocks(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(self.dtype).contiguous().view(torch.uint8).reshape(x.shape[0], -1)

    def decode_blocks(self, b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().reshape(-1).view(self.dtype).to(torch.float32).reshape(b.shape[0], 1)


@register
class F32(_FloatCodec):
    format_name = "F32"
    dtype = torch.float32


@register
class F16(_FloatCodec):
    format_name = "F16"
    dtype = torch.float16


@register
class BF16(_FloatCodec):
    format_name = "BF16"
    dtype = torch.bfloat16
