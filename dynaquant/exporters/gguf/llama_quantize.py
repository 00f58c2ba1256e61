"""A GGUF plan as llama.cpp's ``llama-quantize`` arguments, so that llama.cpp's own tool reproduces it (or a person
edits it there).

Spec followed: ``tools/quantize/quantize.cpp`` and ``src/llama-quant.cpp`` of the llama.cpp that llama-cpp-python
0.3.36 vendors (the pinned one). What they do, and what this module makes of it:

- ``--tensor-type PATTERN=TYPE``: PATTERN is lower-cased, then compiled as a ``std::regex`` (ECMAScript) and
  tried with ``regex_search`` (anywhere in the name, hence our ``^...$`` anchors) on the GGUF tensor name; the
  first matching option, in command-line order, wins. TYPE is a GGML type name, case-insensitive (``q4_k``,
  ``iq2_xxs``, ``bf16``, ``f32``, ``mxfp4``, ``nvfp4`` all parse). Overrides apply only to tensors llama-quantize
  may quantize (:func:`llama_quantizes`) and only when the base type's default GGML type is a quantized one
  (``ggml_is_quantized``): with an ``F16``/``BF16``/``F32`` base they are ignored, so the base here is always a
  quantized file type when any tensor needs an override. Our patterns are disjoint, so their order is free, and
  contain no upper-case letter (``\\d`` would survive the lower-casing, ``\\D`` would not: we use ``[0-9]+``).
- ``--token-embedding-type`` / ``--output-tensor-type``: taken for ``token_embd.weight`` (and
  ``per_layer_token_embd.weight`` unless a pattern names it: we always name it) and ``output.weight`` before any
  pattern; we give them whenever the plan has those tensors.
- ``--pure``: tensors no pattern names get the base type's default type instead of llama.cpp's mix (which would
  bump ``attn_v``, ``ffn_down`` and others), so only tensors whose format differs from the base need a pattern.
- Block-size fallbacks (``tensor_type_fallback``: a row not a multiple of 256 turns Q4_K into Q5_0, ...) run after
  the overrides; the plan's formats are the final ones (after our identical fallback) and fit their rows, so each
  override names the final format and no fallback fires.
- ``--imatrix FILE``: the plan's imatrix (``sources.imatrix``) or the one given. IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S,
  IQ1_S and IQ1_M outside ``token_embd``/``output`` need it (``tensor_requires_imatrix``); a plan that has them and
  names no imatrix is refused. ``token_embd``/``output`` in IQ2_XXS, IQ2_XS or IQ1_S need an imatrix entry for that
  tensor (ggml asserts one): not checked here, llama-quantize aborts without it.
- Tensors llama-quantize never quantizes (norms, 1-D tensors, ``ffn_gate_inp``, position embeddings, ...:
  ``tensor_allows_quantization``) are copied as the input file holds them; a plan giving one of them a quantized
  format is refused, float formats are left to the input (F32 norms in a ``convert_hf_to_gguf.py`` file, as in ours).

Every GGUF format of ours has a GGML type llama-quantize writes as an override (F32, F16, BF16, the legacy, K- and
i-quants, MXFP4, NVFP4). NVFP4 has no llama-quantize file type, so it is never the base. Safetensors plans (runtime
formats) cannot be expressed and are refused.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from dataclasses import dataclass

from dynaquant.quant.formats import get_format
from dynaquant.quant.plan import Plan
from dynaquant.quant.presets import requires_imatrix

TOKEN_EMBD, PER_LAYER_TOKEN_EMBD, OUTPUT = "token_embd.weight", "per_layer_token_embd.weight", "output.weight"

# llama-quantize's positional type (``QUANT_OPTIONS`` in quantize.cpp) whose default GGML type
# (``llama_ftype_get_default_type``) is the format; formats not listed here use their own name, except NVFP4 (none).
_FILE_TYPE_NAMES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "IQ2_S": "IQ2_M", "MXFP4": "MXFP4_MOE"}
_NO_FILE_TYPE = frozenset({"NVFP4"})
_FLOATS = frozenset({"F32", "F16", "BF16"})

# tensor_allows_quantization (llama-quant.cpp): names holding one of these are never quantized ...
_KEPT_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                    "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
                    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
                    *(f"time_mix_{k}.weight" for k in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                                       "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))
# ... nor these names (LLM_TENSOR_POS_EMBD, LLM_TENSOR_TOKEN_TYPES)
_KEPT_NAMES = frozenset({"position_embd.weight", "token_types.weight"})

_BLOCK = re.compile(r"((?:[a-z0-9_]+\.)*?blk\.)([0-9]+)(\..+)")


def llama_quantizes(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether ``llama-quantize`` may change this tensor's type (``tensor_allows_quantization``, without the
    architecture-specific exceptions of GLM5-next): at least 2-D as ggml counts dimensions (trailing ne of 1 do not
    count; ``shape`` is in torch order), a name ending in ``weight``, and none of the excluded names."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:  # torch's leading 1s are ggml's trailing ne
        dims.pop(0)
    if len(dims) < 2 or not name.endswith("weight") or name in _KEPT_NAMES:
        return False
    return not any(s in name for s in _KEPT_SUBSTRINGS)


@dataclass(frozen=True)
class LlamaQuantizeArgs:
    """A plan as ``llama-quantize`` options.

    Attributes:
        base_type: the positional file type (``"Q4_K_M"``, ``"Q8_0"``, ``"BF16"``, ...), as ``QUANT_OPTIONS`` spells it.
        tensor_types: ``(pattern, ggml type)`` pairs for ``--tensor-type PATTERN=TYPE``: anchored, disjoint, lower
            case (``("^blk\\.(0|3)\\.attn_q\\.weight$", "q6_k")``).
        token_embedding_type, output_tensor_type: GGML type names (lower case), or None when the plan has no such
            tensor.
        imatrix: the imatrix file, or None.
    """

    base_type: str
    tensor_types: tuple[tuple[str, str], ...]
    token_embedding_type: str | None = None
    output_tensor_type: str | None = None
    imatrix: str | None = None

    def options(self) -> list[str]:
        """The options before the file names: ``--pure``, ``--imatrix``, the embedding/output types, the overrides."""
        out = ["--pure"]
        if self.imatrix is not None:
            out += ["--imatrix", self.imatrix]
        if self.token_embedding_type is not None:
            out += ["--token-embedding-type", self.token_embedding_type]
        if self.output_tensor_type is not None:
            out += ["--output-tensor-type", self.output_tensor_type]
        for pattern, typ in self.tensor_types:
            out += ["--tensor-type", f"{pattern}={typ}"]
        return out

    def argv(self, model: str = "MODEL-BF16.gguf", output: str = "OUTPUT.gguf",
             executable: str = "llama-quantize") -> list[str]:
        """The whole command: ``[executable, *options, model, output, base_type]``; ``model`` is the unquantized
        GGUF (BF16, F16 or F32, e.g. from ``convert_hf_to_gguf.py``)."""
        return [executable, *self.options(), model, output, self.base_type]

    def command(self, model: str = "MODEL-BF16.gguf", output: str = "OUTPUT.gguf",
                executable: str = "llama-quantize") -> str:
        """:meth:`argv` as a shell command (POSIX quoting), one option per line joined by backslash-newlines."""
        words = self.argv(model, output, executable)
        lines, i = [shlex.quote(words[0])], 1
        while i < len(words) - 3:
            takes_value = words[i] != "--pure"
            lines.append(" ".join(map(shlex.quote, words[i: i + 1 + takes_value])))
            i += 1 + takes_value
        lines.append(" ".join(map(shlex.quote, words[-3:])))
        return " \\\n  ".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: the fields, and ``argv`` with the default placeholders for the file names."""
        return {"base_type": self.base_type, "tensor_types": [list(t) for t in self.tensor_types],
                "token_embedding_type": self.token_embedding_type, "output_tensor_type": self.output_tensor_type,
                "imatrix": self.imatrix, "argv": self.argv()}


def file_type_name(fmt: str) -> str | None:
    """llama-quantize's positional type whose default GGML type is ``fmt`` (``"Q4_K"`` -> ``"Q4_K_M"``), or None."""
    name = get_format(fmt).name
    return None if name in _NO_FILE_TYPE else _FILE_TYPE_NAMES.get(name, name)


def _escape(text: str) -> str:
    return re.escape(text)  # "." -> "\\."; GGUF names are [a-z0-9_.] (upper case is refused before)


def _alternation(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"({'|'.join(items)})"


def _blocks(layers: set[str], every: set[str]) -> str:
    """A regex of block numbers: ``[0-9]+`` for all of ``every``, else the shorter of ``(0|3|7)`` and
    ``(?!(5|9)\\.)[0-9]+`` (every block but 5 and 9; ECMAScript and Python share the lookahead)."""
    if layers == every:
        return "[0-9]+"
    listed = _alternation(sorted(layers, key=int))
    others = f"(?!{_alternation(sorted(every - layers, key=int))}\\.)[0-9]+"
    return others if len(others) < len(listed) else listed


def tensor_type_patterns(wanted: dict[str, str], all_names: list[str]) -> list[tuple[str, str]]:
    """Compact anchored patterns that select exactly the tensors of ``wanted`` (name -> GGML type) among
    ``all_names``, each with its type: block tensors grouped by kind and type (``^blk\\.(0|3|7)\\.attn_q\\.weight$``;
    ``[0-9]+`` when the kind has that type in every block, ``(?!(5|9)\\.)[0-9]+`` in all but a few, whichever is
    shorter), kinds with the same blocks and type merged (``^blk\\.[0-9]+\\.(attn_k|attn_v)\\.weight$``), other
    tensors one pattern each. The patterns are disjoint; their order is that of the tensors' first appearance."""
    layers_of: dict[tuple[str, str], set[str]] = defaultdict(set)  # (prefix, rest) -> every block holding it
    for n in all_names:
        if m := _BLOCK.fullmatch(n):
            layers_of[m[1], m[3]].add(m[2])
    kinds: dict[tuple[str, str, str], list[str]] = {}  # (prefix, rest, type) -> blocks, in first-appearance order
    for n, typ in wanted.items():
        m = _BLOCK.fullmatch(n)
        kinds.setdefault((n, "", typ) if m is None else (m[1], m[3], typ), []).append("" if m is None else m[2])
    merged: dict[tuple[str, str, str], list[str]] = {}  # (prefix, type, blocks expression) -> rests
    for (prefix, rest, typ), layers in kinds.items():
        if not rest:  # a tensor outside the blocks: its own pattern
            merged[prefix, typ, ""] = []
            continue
        merged.setdefault((prefix, typ, _blocks(set(layers), layers_of[prefix, rest])), []).append(rest)
    out = []
    for (prefix, typ, expr), rests in merged.items():
        if not expr:
            out.append((f"^{_escape(prefix)}$", typ))
            continue
        suffix = ".weight" if all(r.endswith(".weight") and len(r) > 7 for r in rests) else ""
        body = _alternation([_escape(r[1: len(r) - len(suffix)]) for r in rests])
        out.append((f"^{_escape(prefix)}{expr}\\.{body}{_escape(suffix)}$", typ))
    return out


def simulate(args: LlamaQuantizeArgs, tensors: dict[str, tuple[int, ...]],
             kept: dict[str, str] | None = None) -> dict[str, str]:
    """The GGML type (upper case, as our format names) ``llama-quantize`` gives each tensor of ``tensors`` (name ->
    shape, torch order) with these arguments, following ``llama_tensor_get_type``: the embedding/output options, then
    the first pattern found by ``re.search`` on the lower-cased pattern (``regex_search``; the two engines agree on
    the anchors, groups, alternations and classes we write), then the base type's default; then the block-size
    fallback. Tensors it does not quantize keep ``kept[name]`` (default ``"F32"``)."""
    default = get_format(_default_type(args.base_type)).name
    quantized_base = default not in _FLOATS
    compiled = [(re.compile(p.lower()), t.upper()) for p, t in args.tensor_types]
    out = {}
    for name, shape in tensors.items():
        if not llama_quantizes(name, shape):
            out[name] = (kept or {}).get(name, "F32")
            continue
        typ = None
        if args.token_embedding_type and name in (TOKEN_EMBD, PER_LAYER_TOKEN_EMBD):
            named = name == PER_LAYER_TOKEN_EMBD and any(p.search(name) for p, _ in compiled)
            typ = None if named else args.token_embedding_type.upper()
        if typ is None and args.output_tensor_type and name == OUTPUT:
            typ = args.output_tensor_type.upper()
        if typ is None:
            typ = default
            if quantized_base:
                typ = next((t for p, t in compiled if p.search(name)), default)
                fmt = get_format(typ)
                while not fmt.fits(shape[-1]):
                    fmt = get_format(fmt.fallback or "F16")
                typ = fmt.name
        out[name] = typ
    return out


def _default_type(base_type: str) -> str:
    """The format a llama-quantize positional type defaults to (inverse of :func:`file_type_name`)."""
    inverse = {v: k for k, v in _FILE_TYPE_NAMES.items()}
    return inverse.get(base_type, base_type)


def llama_quantize_args(plan: Plan, imatrix: str | None = None, source: str = "plan") -> LlamaQuantizeArgs:
    """The ``llama-quantize`` arguments that reproduce ``plan``'s tensor types from an unquantized GGUF of its model.

    Base type: the format holding the most weights among the tensors that need a choice (not the embedding/output),
    counting only formats with a quantized llama-quantize file type; when there are none, the one float format all
    of them share, else Q8_0 with every tensor named. ``imatrix`` defaults to the plan's ``sources["imatrix"]``.
    The arguments are checked with :func:`simulate` against the plan before they are returned.

    Raises:
        ValueError: naming ``source``: a safetensors plan; a tensor name with upper-case letters (llama-quantize
            lower-cases patterns); a quantized format on a tensor llama-quantize never quantizes; formats that need an
            imatrix and none given.
    """
    if plan.target != "gguf":
        raise ValueError(f"{source}: a {plan.target} plan; llama-quantize writes GGUF files only (make a gguf plan)")
    upper = [e.name for e in plan.entries if e.name != e.name.lower()]
    if upper:
        raise ValueError(f"{source}: tensor {upper[0]} has upper-case letters; llama-quantize lower-cases "
                         "--tensor-type patterns, so no pattern can name it")
    kept_bad = [f"{e.name} ({e.format})" for e in plan.entries
                if not llama_quantizes(e.name, e.shape) and e.format not in _FLOATS]
    if kept_bad:
        raise ValueError(f"{source}: llama-quantize never quantizes {', '.join(kept_bad[:5])}"
                         + (" ..." if len(kept_bad) > 5 else "") + " (it copies them from its input); "
                         "give them a float format")
    imatrix = imatrix if imatrix is not None else plan.sources.get("imatrix")
    needs = [f"{e.name} ({e.format})" for e in plan.entries if requires_imatrix(e.name, e.format)]
    if needs and imatrix is None:
        raise ValueError(f"{source}: {len(needs)} tensor(s) are in formats llama-quantize writes only with an imatrix "
                         f"(IQ3_XXS, IQ2_*, IQ1_*): {', '.join(needs[:5])}" + (" ..." if len(needs) > 5 else "")
                         + "; the plan names none (sources.imatrix): give one")
    fmts = {e.name: e.format for e in plan.entries if llama_quantizes(e.name, e.shape)}
    special = {TOKEN_EMBD, OUTPUT}
    choice = {n: f for n, f in fmts.items() if n not in special}
    weights: dict[str, int] = defaultdict(int)
    for e in plan.entries:
        if e.name in choice and file_type_name(e.format) and e.format not in _FLOATS:
            weights[e.format] += e.n_elements
    if weights:
        base = max(sorted(weights), key=lambda f: weights[f])
    else:
        floats = set(choice.values())
        # under a float base no pattern applies, and per_layer_token_embd follows --token-embedding-type
        same_embd = fmts.get(PER_LAYER_TOKEN_EMBD) in (None, fmts.get(TOKEN_EMBD))
        base = floats.pop() if len(floats) == 1 and floats <= _FLOATS and same_embd else "Q8_0"
    quantized_base = base not in _FLOATS
    wanted = {n: f.lower() for n, f in choice.items() if quantized_base and (f != base or n == PER_LAYER_TOKEN_EMBD)}
    args = LlamaQuantizeArgs(
        base_type=file_type_name(base) or base,
        tensor_types=tuple(tensor_type_patterns(wanted, [e.name for e in plan.entries])),
        token_embedding_type=fmts[TOKEN_EMBD].lower() if TOKEN_EMBD in fmts else None,
        output_tensor_type=fmts[OUTPUT].lower() if OUTPUT in fmts else None,
        imatrix=None if imatrix is None else str(imatrix))
    got = simulate(args, {e.name: e.shape for e in plan.entries}, {e.name: e.format for e in plan.entries})
    wrong = [n for n, f in plan.formats().items() if got[n] != f]
    if wrong:  # a bug here, not bad input: the arguments would not reproduce the plan
        raise AssertionError(f"{source}: llama-quantize arguments would give {wrong[0]} {got[wrong[0]]}, "
                             f"the plan has {plan.formats()[wrong[0]]}")
    return args
