"""``bitdecode layout``: draw the layouts of ``layouts/`` as coloured thread-value grids.

Views (subcommands):

* ``mma``       the MMA operand and accumulator fragments: each cell is ``thread:value``
* ``ldmatrix``  how ldmatrix x4 hands the packed words of one 16-byte chunk to the lanes
                (and, on sm90/sm100, how stmatrix stores the dequantized fragments)
* ``packed``    the words of one packed row and the column each bit field holds
* ``remap``     the bit interleave inside a word and the lop3 / shift / mask / magic
                sequence that undoes it
* ``params``    the order of the (scale, zero) words (or, for NVFP4/MXFP4, scale bytes)
* ``swizzle``   the shared-memory tiles the kernels use: the banks of each 16-byte chunk

Every table comes from ``bitdecode.layouts`` (evaluated in a CuTe trace, no GPU); ``--svg``
writes the same picture as an SVG file.
"""

from __future__ import annotations

import colorsys
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

from ._files import cannot_write, write_whole
from .cli import DTYPE_NAMES, output_file, print_error
from .formats import BITS, HEAD_DIMS, K_MODES
from .layouts import sm80

ARCHS = ("sm80", "sm90", "sm100")
OPERANDS = ("q", "k", "p", "v")
FORMATS = ("int", "nvfp4", "mxfp4")

VIEWS = {
    "mma": "MMA operand / accumulator fragments (thread:value per element)",
    "ldmatrix": "ldmatrix x4 of packed words per lane (sm90/sm100: and the stmatrix store)",
    "packed": "words of a packed row and the column each bit field holds",
    "remap": "bit interleave of a word and the lop3/shift/mask/magic dequant sequence",
    "params": "order of the (scale, zero) words; block scales for NVFP4/MXFP4",
    "swizzle": "shared-memory swizzles: banks of every 16-byte chunk, conflict counts",
}


class LayoutError(Exception):
    """A view that has no meaning for the chosen arch / operand / format."""


# --------------------------------------------------------------------------------------
# Figure model
# --------------------------------------------------------------------------------------


@dataclass
class Cell:
    text: str
    key: Optional[int] = None  # colour index (thread, lane, bank group, ...); None = blank


@dataclass
class Grid:
    title: str
    row_labels: List[str]
    col_labels: List[str]
    cells: List[List[Cell]]
    legend: str = ""


@dataclass
class Figure:
    title: str
    grids: List[Grid] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _colour(key: int) -> str:
    """A light colour per key; consecutive keys far apart in hue (golden-ratio steps)."""
    hue = (key * 0.6180339887) % 1.0
    light = 0.80 if (key // 8) % 2 == 0 else 0.70
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.65)
    return "#{:02x}{:02x}{:02x}".format(int(r * 255), int(g * 255), int(b * 255))


def _tv_grid(title: str, table, rows: int, cols: int, row_name: str, col_name: str,
             legend: str, row_offset: int = 0) -> Grid:
    """Grid of a thread-value table ``table[thread][value] = (row, col)``."""
    cells = [[Cell("") for _ in range(cols)] for _ in range(rows)]
    for t, values in enumerate(table):
        for v, (r, c) in enumerate(values):
            r -= row_offset
            if 0 <= r < rows and 0 <= c < cols:
                cells[r][c] = Cell(f"{t}:{v}", t % 32)
    return Grid(title, [f"{row_name} {r + row_offset}" for r in range(rows)],
                [str(c) for c in range(cols)], cells, legend)


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def render_rich(fig: Figure, console) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console.print(Text(fig.title, style="bold"))
    for grid in fig.grids:
        table = Table(title=grid.title, box=box.SIMPLE_HEAD, padding=(0, 0), collapse_padding=True,
                      title_justify="left", caption=grid.legend or None, caption_justify="left")
        table.add_column("", style="dim", no_wrap=True,
                         min_width=max([len(s) for s in grid.row_labels] + [1]))
        widths = _column_chars(grid)
        for label, w in zip(grid.col_labels, widths):
            table.add_column(label, justify="center", no_wrap=True, min_width=w + 2)
        for label, row in zip(grid.row_labels, grid.cells):
            out = [Text(label)]
            for cell in row:
                if cell.key is None:
                    out.append(Text(f" {cell.text} "))
                else:
                    out.append(Text(f" {cell.text} ", style=f"#000000 on {_colour(cell.key)}"))
            table.add_row(*out)
        needed = max([len(s) for s in grid.row_labels] + [1]) + sum(w + 2 for w in widths) + 4
        console.print(table, width=max(console.width, needed), crop=False)
    for note in fig.notes:
        console.print(Text("  " + note))


def _column_chars(grid: Grid) -> List[int]:
    """Characters each column needs: its longest header line or cell text."""
    out = [max(len(part) for part in label.split("\n")) for label in grid.col_labels]
    for row in grid.cells:
        for j, cell in enumerate(row):
            out[j] = max(out[j], len(cell.text))
    return out


CHAR_W = 7.0
ROW_H = 18
TITLE_H = 22


def render_svg(fig: Figure) -> str:
    """The figure as a self-contained SVG document (plain string formatting)."""
    parts: List[str] = []
    width = 0.0
    y = 28.0
    parts.append(f'<text x="8" y="18" font-size="14" font-weight="bold">{escape(fig.title)}</text>')
    for grid in fig.grids:
        label_w = CHAR_W * max([len(s) for s in grid.row_labels] + [1]) + 10
        col_w = [CHAR_W * n + 10 for n in _column_chars(grid)]
        y += TITLE_H
        parts.append(f'<text x="8" y="{y - 6:.0f}" font-size="13" font-weight="bold">{escape(grid.title)}</text>')
        width = max(width, 16 + 8 * len(grid.title))
        header_lines = max([len(label.split("\n")) for label in grid.col_labels] + [1])
        x = 8 + label_w
        for j, label in enumerate(grid.col_labels):
            for k, part in enumerate(label.split("\n")):
                parts.append(f'<text x="{x + col_w[j] / 2:.1f}" y="{y + 13 + k * 14:.0f}" text-anchor="middle" '
                             f'fill="#555">{escape(part)}</text>')
            x += col_w[j]
        width = max(width, x + 8)
        y += ROW_H + 14 * (header_lines - 1)
        for label, row in zip(grid.row_labels, grid.cells):
            parts.append(f'<text x="{8 + label_w - 6:.1f}" y="{y + 13:.0f}" text-anchor="end" '
                         f'fill="#555">{escape(label)}</text>')
            x = 8 + label_w
            for j, cell in enumerate(row):
                fill = "#ffffff" if cell.key is None else _colour(cell.key)
                parts.append(f'<rect x="{x:.1f}" y="{y:.0f}" width="{col_w[j]:.1f}" height="{ROW_H}" '
                             f'fill="{fill}" stroke="#999" stroke-width="0.5"/>')
                if cell.text:
                    parts.append(f'<text x="{x + col_w[j] / 2:.1f}" y="{y + 13:.0f}" '
                                 f'text-anchor="middle">{escape(cell.text)}</text>')
                x += col_w[j]
            y += ROW_H
        if grid.legend:
            y += 16
            parts.append(f'<text x="8" y="{y:.0f}" fill="#333">{escape(grid.legend)}</text>')
            width = max(width, 16 + CHAR_W * len(grid.legend))
        y += 10
    for note in fig.notes:
        y += 16
        parts.append(f'<text x="8" y="{y:.0f}" fill="#333">{escape(note)}</text>')
        width = max(width, 16 + CHAR_W * len(note))
    height = y + 12
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="11">')
    return "\n".join([head, '<rect width="100%" height="100%" fill="#ffffff"/>', *parts, "</svg>"]) + "\n"


# --------------------------------------------------------------------------------------
# Helpers shared by the views
# --------------------------------------------------------------------------------------


def _is_fp4(args) -> bool:
    return args.format in ("nvfp4", "mxfp4")


def _check_format(args) -> None:
    if _is_fp4(args) and args.arch != "sm100":
        raise LayoutError(f"--format {args.format} is a Blackwell (sm100) format; use --arch sm100 "
                          f"or --format int")
    if _is_fp4(args) and args.bits != 4:
        raise LayoutError(f"{args.format} codes are 4-bit e2m1: --bits {args.bits} has no meaning there")


def _packed_operand(args) -> str:
    if args.operand in ("q", "p"):
        raise LayoutError(f"{args.operand.upper()} stays 16-bit in the integer formats: only K and V "
                          f"are packed (use --operand k or v)")
    return args.operand


def _packed_length(args) -> int:
    from .layouts import sm80

    return args.head_dim if args.operand == "k" else sm80.residual_block(args.bits)


def _row_meaning(operand: str) -> Tuple[str, str]:
    return ("token", "channel") if operand == "k" else ("channel", "token")


def _lane_cells(words: int, fields: Sequence[Tuple[int, int]], elements, key: Callable[[int], int]):
    return [[Cell(str(elements[w][e]), key(w)) for _, e in fields] for w in range(words)]


def _field_columns(bits: int) -> List[Tuple[int, int]]:
    """(field index, element) from the most significant field to the least."""
    from .layouts import packing

    f = packing.codes_per_word(bits)
    return [(f - 1 - i, e) for i, e in enumerate(packing.interleave(bits))]


def _field_label(bits: int, fld: int, element: int) -> str:
    lo = fld * bits
    return f"b{lo + bits - 1}:{lo}\ne{element}"


# --------------------------------------------------------------------------------------
# mma
# --------------------------------------------------------------------------------------

_SM80_MMA = {
    # operand: (fragment, what, rows, cols, product)
    "q": ("b", "Q: B operand", "head", "ch", "S^T = K . Q^T"),
    "k": ("a", "K: A operand", "token", "ch", "S^T = K . Q^T"),
    "p": ("b", "P: B operand", "head", "token", "O^T = V^T . P^T"),
    "v": ("a", "V^T: A operand", "ch", "token", "O^T = V^T . P^T"),
}
_SM80_ACC = {"S^T = K . Q^T": ("token", "head"), "O^T = V^T . P^T": ("ch", "head")}


def view_mma(args) -> Figure:
    from .layouts import sm80, sm90

    _check_format(args)
    if args.arch == "sm100":
        raise LayoutError(
            "tcgen05 MMAs have no per-thread operand fragments: one thread issues them, A and B "
            "are read from shared memory by descriptor and the accumulator lives in tensor "
            "memory. See `bitdecode layout swizzle --arch sm100` (operand tiles) and "
            "`bitdecode layout params --arch sm100 --format nvfp4` (scale factors).")
    legend = "cell = thread:value (register order); colour = lane"
    if args.arch == "sm80":
        frag, what, rname, cname, product = _SM80_MMA[args.operand]
        shape = sm80.MMA_OPERAND_SHAPES[frag]
        fig = Figure(f"sm80 mma.sync m16n8k16 ({args.dtype}): {what} of {product}")
        fig.grids.append(_tv_grid(f"{what} ({shape[0]} x {shape[1]})", sm80.fragment(frag), shape[0], shape[1],
                                  rname, cname, legend))
        ar, ac = _SM80_ACC[product]
        fig.grids.append(_tv_grid(f"accumulator of {product} (16 x 8, fp32)", sm80.fragment("c"), 16, 8,
                                  ar, ac, legend))
        fig.notes += [
            "Query transformation: the gq query heads sharing one KV head are the N = 8 columns "
            "(padded to a multiple of 8); tokens (K) and channels (V^T) fill the M = 16 rows.",
            "Quad lane c = lane % 4 holds columns (2c, 2c+1, 2c+8, 2c+9) of every 16-wide k block, "
            f"in both operands: sm80.fragment_columns() = {sm80.fragment_columns()}.",
        ]
        return fig
    # sm90
    shown_n = 16
    if args.operand == "p":
        fig = Figure(f"sm90 wgmma 64xNx16 ({args.dtype}): P as A from registers (RS) in O = P . V")
        fig.grids.append(_tv_grid("P: A operand fragment (64 x 16), 4 warps x 16 rows",
                                  sm90.wgmma_fragment("a"), 64, 16, "head", "token",
                                  "cell = thread:value; thread = 32*warp + lane; colour = lane"))
        fig.grids.append(_tv_grid(f"O accumulator (64 x N, first {shown_n} columns)", sm90.wgmma_fragment("c", 64),
                                  64, shown_n, "head", "ch", "the pattern repeats every 8 columns"))
        fig.notes.append("The S accumulator converted to 16 bits is exactly this A fragment (FA3-style), "
                         "so P never leaves registers.")
        return fig
    if args.operand == "q":
        fig = Figure(f"sm90 wgmma 64xNx16 ({args.dtype}): Q as A from shared memory (SS) in S = Q . K^T")
        fig.grids.append(_tv_grid(f"S accumulator (64 x Nr, first {shown_n} columns)", sm90.wgmma_fragment("c", 64),
                                  64, shown_n, "head", "token",
                                  "cell = thread:value; thread = 32*warp + lane; colour = lane"))
        fig.notes += [
            f"Query transformation: the gq query heads of one KV head are the M rows, padded to "
            f"{sm90.WGMMA_M} (sm90.query_tile_rows); Q is read from a K-major 128B-swizzled tile "
            "by descriptor (no per-thread fragment; see `layout swizzle --arch sm90 --operand q`).",
        ]
        return fig
    role = "K tile (Nr tokens x D)" if args.operand == "k" else "V tile (D channels x Nr tokens)"
    fig = Figure(f"sm90: dequantized {args.operand.upper()} fragments stored with stmatrix into the wgmma B {role}")
    fig.grids.append(_tv_grid("stmatrix x4 source = m16n8k16 A fragment (one 16 x 16 block)",
                              sm90.stsm_fragment(), 16, 16, "row", "col", legend))
    addr = sm90.stsm_row_addresses()
    cells = [[Cell("") for _ in range(2)] for _ in range(16)]
    for lane, (r, c0) in enumerate(addr):
        cells[r][c0 // 8] = Cell(f"lane {lane}", lane)
    fig.grids.append(Grid("stmatrix row addresses: lane -> 8 contiguous 16-bit values", [f"row {r}" for r in range(16)],
                          ["cols 0-7", "cols 8-15"], cells, "colour = lane"))
    fig.notes += [
        "The lop3 dequant of the packed words (unchanged from sm80) yields these A fragments; "
        "wgmma reads B from shared memory by descriptor (no per-thread layout).",
        "RS alternative: wgmma's register A fragment of warp w is the m16n8k16 A fragment of rows "
        "16w..16w+15, so dequantized K / V^T feed it directly (heads become N, padded to 8).",
    ]
    return fig


# --------------------------------------------------------------------------------------
# ldmatrix
# --------------------------------------------------------------------------------------


def view_ldmatrix(args) -> Figure:
    from .layouts import sm80, sm90

    _check_format(args)
    if _is_fp4(args):
        raise LayoutError(f"{args.format} operands are read from shared memory by tcgen05 itself: no ldmatrix")
    operand = _packed_operand(args)
    rname, cname = _row_meaning(operand)
    lane_word = sm80.ldmatrix_lane_word()
    rows, words = 4 * sm80.LDSM_ROWS, sm80.CHUNK_WORDS
    cells = [[Cell("") for _ in range(words + 1)] for _ in range(rows)]
    for i in range(4):
        for r in range(sm80.LDSM_ROWS):
            addr_lane = 8 * i + r
            cells[8 * i + r][0] = Cell(f"{addr_lane}", addr_lane)
        for lane, (r, w) in enumerate(lane_word):
            cells[8 * i + r][w + 1] = Cell(f"{lane}:r{i}", lane)
    fig = Figure(f"{args.arch}: ldmatrix x4 (non-transposed) of one 16-byte chunk of 32 packed "
                 f"{operand.upper()} rows ({rname}s)")
    fig.grids.append(Grid("packed rows g + 8i of a 32-row block; word c of the chunk",
                          [f"{rname} {r}" for r in range(rows)], ["addr lane"] + [f"word {c}" for c in range(words)],
                          cells, "cell = lane:register; lane 4g+c gets word c of row g+8i in register i"))
    kpw = sm80.k_blocks_per_word(args.bits)
    fig.notes += [
        f"Each word holds {kpw} k-blocks x the lane's 4 columns ({args.bits}-bit): chunk j covers "
        f"{cname}s {sm80.chunk_columns(args.bits)}*j ... of the row.",
        "Registers r0..r3 are the words of rows g, g+8, g+16, g+24: (r0, r1) feed m-tile 0 "
        "(row halves 0, 1), (r2, r3) m-tile 1.",
    ]
    if args.arch in ("sm90", "sm100"):
        fig.grids.append(_tv_grid("then stmatrix x4 stores each dequantized 16 x 16 block (source = A fragment)",
                                  sm90.stsm_fragment(), 16, 16, "row", "col",
                                  "cell = lane:value; matrix q = h + 2*ch takes register pair (h, ch)"))
        targets = sm90.dequant_pair_targets(args.bits)
        tcells = [[Cell(f"mt{mt} kb{kb} v{v},{v + 1}", 4 * i + p) for p, (mt, kb, v) in enumerate(row)]
                  for i, row in enumerate(targets)]
        fig.grids.append(Grid("dequantized pair p of register r_i -> stmatrix block (mt, kb) values",
                              [f"r{i}" for i in range(4)], [f"pair {p}" for p in range(len(targets[0]))], tcells,
                              "mt = 16-row block of the load, kb = k-block of the chunk"))
    return fig


# --------------------------------------------------------------------------------------
# packed
# --------------------------------------------------------------------------------------


def view_packed(args) -> Figure:
    from .layouts import packing, sm80

    _check_format(args)
    if _is_fp4(args):
        return _packed_fp4(args)
    operand = _packed_operand(args)
    length = _packed_length(args)
    rname, cname = _row_meaning(operand)
    words = sm80.words_per_row(args.bits, length)
    elements = sm80.word_elements(args.bits, length)
    fields = _field_columns(args.bits)
    f = packing.codes_per_word(args.bits)
    what = (f"K row = one token, {length} channels" if operand == "k"
            else f"V row = one channel, the {length} tokens (Nr) of a residual block")
    fig = Figure(f"{args.arch}: packed {args.bits}-bit {operand.upper()} row ({what}): "
                 f"{words} words x {f} fields")
    labels = []
    for w in range(words):
        j, c = divmod(w, sm80.CHUNK_WORDS)
        owner = f" warp{j}" if operand == "v" else ""
        labels.append(f"w{w} j{j} c{c}{owner}")
    fig.grids.append(Grid(f"word w = 4*chunk j + quad lane c; each field holds the {cname} shown",
                          labels, [_field_label(args.bits, fld, e) for fld, e in fields],
                          _lane_cells(words, fields, elements, lambda w: w % 4),
                          "columns: bit field (msb..lsb) and the element it holds; colour = quad lane c"))
    pairs = f // 2
    pcells = [[Cell(f"{elements[w][2 * p]},{elements[w][2 * p + 1]}", w % 4) for p in range(pairs)]
              for w in range(sm80.CHUNK_WORDS)]
    fig.grids.append(Grid("after the lop3 dequant: the half2 pairs of chunk 0's words (A fragment registers)",
                          [f"w{w} lane c={w}" for w in range(sm80.CHUNK_WORDS)],
                          [f"pair {p}\nkb{p // 2} ch{p % 2}" for p in range(pairs)], pcells,
                          f"cell = the two {cname}s of the pair; kb = k-block of the chunk, ch = column half"))
    nr = sm80.residual_block(args.bits)
    if operand == "k":
        fig.notes.append(f"k_pack [pages, Hkv, page, D*bits/32]: rows are tokens ({args.head_dim} channels "
                         f"-> {words} words = {words * 4} bytes).")
    else:
        fig.notes.append(f"v_pack [pages, Hkv, page/Nr, D, Nr*bits/32] with Nr = {nr}: rows are channels; "
                         f"warp w of the decode kernel owns chunk w = tokens [{nr // 4}w, {nr // 4}(w+1)).")
    fig.notes += [
        f"Element e = 4*(k-block within chunk) + v sits at field (e%2)*{f // 2} + e//2 "
        f"(interleave {packing.interleave_string(args.bits)}); v indexes the lane's columns (2c, 2c+1, 2c+8, 2c+9).",
        "ldmatrix x4 of four 8-row blocks of one chunk gives lane 4g+c word c of rows g+8i: exactly its words.",
    ]
    if args.arch != "sm80":
        fig.notes.append(f"The packed bytes are the same on {args.arch}: only what happens after the lop3 "
                         "dequant differs (see `layout ldmatrix` / `layout swizzle`).")
    return fig


def _packed_fp4(args) -> Figure:
    from .layouts import sm100

    vec = sm100.SF_VEC[args.format]
    length = args.head_dim if args.operand in ("q", "k") else 128
    rname, cname = {"q": ("head", "channel"), "k": ("token", "channel"),
                    "p": ("head", "token"), "v": ("channel", "token")}[args.operand]
    shown = min(length // 2, 32)
    cells = [[Cell(str(2 * b + 1), (2 * b + 1) // vec), Cell(str(2 * b), (2 * b) // vec)] for b in range(shown)]
    fig = Figure(f"sm100 {args.format}: one K-major {args.operand.upper()} row ({rname}), {length} {cname}s "
                 f"of e2m1 codes, two per byte")
    fig.grids.append(Grid(f"bytes 0..{shown - 1} of the row: the {cname} each nibble holds",
                          [f"byte {b}" for b in range(shown)], ["b7:4", "b3:0"], cells,
                          f"colour = scale group: one {sm100.SF_NAME[args.format]} scale per {vec} {cname}s"))
    fig.notes += [
        f"value = e2m1(code) x {sm100.SF_NAME[args.format]} scale x fp32 per-head scale; "
        f"e2m1 codes 0..15 = {', '.join(f'{v:g}' for v in sm100.E2M1_VALUES)}.",
        "Scale bytes follow the 128 x 4 basic chunk (see `layout params --arch sm100 --format ...`).",
    ]
    return fig


# --------------------------------------------------------------------------------------
# remap
# --------------------------------------------------------------------------------------


def view_remap(args) -> Figure:
    from .layouts import packing

    _check_format(args)
    if _is_fp4(args):
        raise LayoutError(f"{args.format} codes go to the block-scaled MMA as they are: there is no remap")
    _packed_operand(args)
    bits, dtype = args.bits, args.dtype
    fields = _field_columns(bits)
    fig = Figure(f"remap of a {bits}-bit word for {dtype}: interleave \"{packing.interleave_string(bits)}\" "
                 f"(fields msb -> lsb hold these elements)")
    fig.grids.append(Grid("the element each field holds (element pair (2p, 2p+1) -> half2 p)", ["word"],
                          [f"b{fld * bits + bits - 1}:{fld * bits}" for fld, _ in fields],
                          [[Cell(f"e{e}", e // 2) for _, e in fields]], "colour = the half2 register pair p"))
    steps = packing.dequant_steps(bits, dtype)
    cols = ["elements", "shift", "mask", "magic", "lop3", "mult", "fma scale", "fma bias"]
    rows = []
    for s in steps:
        rows.append([Cell(f"{2 * s.pair},{2 * s.pair + 1}", s.pair), Cell(f">> {s.shift}", s.pair),
                     Cell(f"0x{s.mask:08x}", s.pair), Cell(f"0x{s.magic:08x}", s.pair),
                     Cell(f"0x{packing.LOP3_AND_OR:02x}", s.pair), Cell(str(s.mult), s.pair),
                     Cell(f"{s.fix_scale:g}", s.pair), Cell(f"{s.fix_bias(dtype):g}", s.pair)])
    fig.grids.append(Grid(f"dequant steps ({len(steps)} pairs, shifts {packing.distinct_shifts(bits, dtype)})",
                          [f"pair {s.pair}" for s in steps], cols, rows, "colour = pair"))
    fig.notes += [
        "t = lop3(w >> shift, mask, magic, 0xea)   # (w & mask) | magic: two 16-bit floats magic + code*mult",
        "q = fma(t, fma scale, fma bias)          # half2 / bfloat162: exactly the two codes",
        "x = fma(q, scale, zero)                  # the (scale, zero) pair of the elements' group",
        f"magic {packing.MAGIC_BITS[dtype]:#06x} = {packing.MAGIC_VALUE[dtype]:g} in {dtype}: "
        f"its mantissa ({packing.MANTISSA_BITS[dtype]} bits) has room for the code shifted by at most "
        f"{packing.MANTISSA_BITS[dtype] - bits} bits.",
    ]
    return fig


# --------------------------------------------------------------------------------------
# params
# --------------------------------------------------------------------------------------


def view_params(args) -> Figure:
    from .layouts import sm80

    _check_format(args)
    if _is_fp4(args):
        return _params_fp4(args)
    operand = _packed_operand(args)
    legend = "cell = column (channel or token) whose (scale, zero) the position holds; colour = quad lane c"
    if operand == "k" and args.k_mode == "token":
        groups = args.head_dim // 32
        cells = [[Cell(f"ch {32 * j}+", j) for j in range(groups)] for _ in range(4)]
        fig = Figure(f"{args.arch}: K per token params (natural order), shown for G = 32, D = {args.head_dim}")
        fig.grids.append(Grid("k_params [pages, Hkv, page, D/G]: one (scale, zero) word per token per channel group",
                              [f"token {t}" for t in range(4)], [f"word {j}" for j in range(groups)], cells,
                              "colour = channel group"))
        fig.notes.append("A lane fetches, per token row of its fragment, the word of the group of its columns.")
        return fig
    length = args.head_dim if operand == "k" else sm80.MMA_SHAPE[2]
    order = sm80.fragment_order(length)
    k = sm80.MMA_SHAPE[2]
    cells = [[Cell(str(order[k * kt + p]), p // 4) for p in range(k)] for kt in range(length // k)]
    if operand == "k":
        fig = Figure(f"{args.arch}: K per channel params in fragment order along D = {args.head_dim}")
        title = "k_params [pages, Hkv, page/G, D]: position 16*kt + 4c + v holds channel"
        row = "kt"
    else:
        fig = Figure(f"{args.arch}: V params (per token) in fragment order along the tokens")
        title = "v_params [pages, Hkv, page/16, D/G, 16]: position 4c + v of a 16-token group holds token"
        row = "tokens"
    fig.grids.append(Grid(title, [f"{row} {kt}" if operand == "k" else "16-token group" for kt in range(len(cells))],
                          [str(p) for p in range(k)], cells, legend))
    fig.notes += [
        "Lane c loads positions 4c..4c+3 (one 16-byte shared-memory load) = the (scale, zero) of its "
        "columns (2c, 2c+1, 2c+8, 2c+9) of the k block: pairs (v0, v1) for col half 0, (v2, v3) for half 1.",
        "Each word: scale in the low 16 bits, zero in the high 16 bits (half2 / bfloat162).",
    ]
    return fig


def _params_fp4(args) -> Figure:
    from .layouts import sm100

    fmt = args.format
    vec = sm100.SF_VEC[fmt]
    offsets = sm100.sf_offsets(fmt, sm100.SF_ATOM_ROWS, sm100.SF_ATOM_COLS * vec)
    cells = [[Cell(str(offsets[32 * m1 + m0][s]), m1) for m1 in range(4) for s in range(sm100.SF_ATOM_COLS)]
             for m0 in range(32)]
    cols = [f"m+{32 * m1} s{s}" for m1 in range(4) for s in range(sm100.SF_ATOM_COLS)]
    fig = Figure(f"sm100 {fmt}: {sm100.SF_NAME[fmt]} scale factors, one per {vec} values along K "
                 f"(basic chunk 128 rows x 4 scales = 512 bytes)")
    fig.grids.append(Grid("byte offset of the scale of row m = m0 + 32*m1, scale column s",
                          [f"m0 {m}" for m in range(32)], cols, cells, "colour = m1 (row quarter)"))
    fig.notes += [
        f"tile_atom_to_shape_SF tiles the chunk over the operand with the scale columns fastest; "
        f"one MMA (K = 64) reads {sm100.sf_per_mma(fmt)} scales per row.",
        "The per-head fp32 scale multiplies the fp32 accumulator.",
    ]
    return fig


# --------------------------------------------------------------------------------------
# swizzle
# --------------------------------------------------------------------------------------


@dataclass
class _Tile:
    title: str
    rows: int
    row_bytes: int
    offsets: Callable[[], Sequence[Sequence[int]]]  # physical offset (in elem units) of (row, col)
    elem_bits: int
    phases: Tuple[str, ...]  # access phases to check: "ldmatrix", "cpasync", "stmatrix"


def _chunk_starts(tile: _Tile):
    """Physical byte address of each 16-byte chunk of each row."""
    offs = tile.offsets()
    per_chunk = 8 * sm80.CHUNK_BYTES // tile.elem_bits
    return [[offs[r][q * per_chunk] * tile.elem_bits // 8 for q in range(tile.row_bytes // sm80.CHUNK_BYTES)]
            for r in range(tile.rows)]


def _bank_span(addr: int) -> str:
    """The banks a 16-byte chunk at byte address ``addr`` covers, e.g. ``8-11``."""
    first = (addr // sm80.BANK_BYTES) % sm80.SMEM_BANKS
    return f"{first}-{first + sm80.CHUNK_BYTES // sm80.BANK_BYTES - 1}"


def conflicts(starts, phase: str) -> int:
    """Extra shared-memory wavefronts over all 8-address phases of ``phase`` (0 = conflict-free)."""
    rows, chunks = len(starts), len(starts[0])
    groups = []
    if phase in ("ldmatrix", "stmatrix"):  # 8 row addresses of one 8x8 tile (rows r0..r0+7, one chunk)
        for r0 in range(0, rows - rows % 8, 8):
            for q in range(chunks):
                groups.append([starts[r0 + r][q] for r in range(8)])
    else:  # cp.async / TMA: 8 consecutive 16-byte chunks in row-major order
        flat = [starts[r][q] for r in range(rows) for q in range(chunks)]
        groups = [flat[i:i + 8] for i in range(0, len(flat) - len(flat) % 8, 8)]
    extra = 0
    banks, words = sm80.SMEM_BANKS, sm80.CHUNK_BYTES // sm80.BANK_BYTES
    for g in groups:
        count = [0] * banks
        for addr in g:
            for k in range(words):
                count[(addr // sm80.BANK_BYTES + k) % banks] += 1
        extra += max(count) - 1
    return extra


def _swizzle_tiles(args) -> List[_Tile]:
    from .layouts import sm80, sm90, sm100

    d, bits = args.head_dim, args.bits
    nr = sm80.residual_block(bits)
    op = args.operand
    if args.arch == "sm80":
        if op == "p":
            raise LayoutError("P never goes through shared memory on sm80: the B fragment of "
                              "O^T = V^T . P^T is made from the S^T accumulator in registers (movmatrix)")
        if op == "q":
            return [_Tile(f"Q tile (16 heads x {d} {args.dtype})", 16, 2 * d,
                          lambda: sm80.smem_offsets(16, 2 * d), 16, ("ldmatrix", "cpasync"))]
        pb = d * bits // 8 if op == "k" else nr * bits // 8
        prow = nr if op == "k" else d
        what = (f"packed K tile ({prow} tokens x {pb} B)" if op == "k"
                else f"packed V tile ({prow} channels x {pb} B)")
        shown = min(prow, 32)
        return [
            _Tile(what, shown, pb, lambda: sm80.smem_offsets(shown, pb), 16, ("ldmatrix", "cpasync")),
            _Tile(f"16-bit residual {op.upper()} sub-tile (64 tokens x {2 * d} B)", 16, 2 * d,
                  lambda: sm80.smem_offsets(16, 2 * d), 16, ("ldmatrix", "cpasync")),
        ]
    if args.arch == "sm90":
        if op == "p":
            raise LayoutError("P feeds wgmma from registers on sm90 (RS: the S accumulator is already "
                              "an A fragment): it has no shared-memory tile")
        if op == "q":
            return [_Tile(f"Q tile (64 padded heads x {d} {args.dtype}, K-major)", 16, 2 * d,
                          lambda: sm90.operand_smem_offsets(16, d), 16, ("cpasync",))]
        rows, cols = sm90.tile_shape(bits, op, d)
        pb = d * bits // 8 if op == "k" else nr * bits // 8
        prow = nr if op == "k" else d
        # as the kernel's default boxes place it (``WIDE_BOXES``: ``fold`` rows to a box row)
        fold, shown = sm90.packed_fold(prow, pb, sm90.WIDE_BOXES), min(prow, 32)
        boxes = f", {fold} rows to a 128-byte TMA box row" if fold > 1 else ""
        return [
            _Tile(f"packed {op.upper()} tile ({shown} of {prow} rows x {pb} B, TMA swizzle{boxes})", shown, pb,
                  lambda: sm90.packed_smem_offsets(prow, pb, sm90.WIDE_BOXES)[:shown], 16, ("ldmatrix", "cpasync")),
            _Tile(f"dequantized {op.upper()} B tile ({16} of {rows} rows x {cols} {args.dtype}, K-major)",
                  16, 2 * cols, lambda: sm90.operand_smem_offsets(16, cols), 16, ("stmatrix",)),
        ]
    # sm100
    if _is_fp4(args):
        cols = d if op in ("q", "k") else 128
        return [_Tile(f"{args.format} e2m1 {op.upper()} operand tile (16 of 128 rows x {cols // 2} B, K-major)",
                      16, cols // 2, lambda: sm100.operand_smem_offsets("e2m1", 16, cols), 4, ("cpasync",))]
    if op == "p":
        raise LayoutError("the integer formats only dequantize K and V on sm100; P is converted by the "
                          "kernel (see --format nvfp4)")
    if op == "q":
        return [_Tile(f"Q tile (K-major, {d} {args.dtype})", 16, 2 * d,
                      lambda: sm100.operand_smem_offsets(args.dtype, 16, d), 16, ("cpasync",))]
    rows, cols = sm90.tile_shape(bits, op, d)
    return [_Tile(f"dequantized {op.upper()} operand tile (16 of {rows} rows x {cols} {args.dtype}, K-major)",
                  16, 2 * cols, lambda: sm100.operand_smem_offsets(args.dtype, 16, cols), 16, ("stmatrix",))]


def view_swizzle(args) -> Figure:
    _check_format(args)
    tiles = _swizzle_tiles(args)
    fig = Figure(f"{args.arch}: shared-memory tiles for operand {args.operand.upper()} "
                 f"({args.bits}-bit, D = {args.head_dim}): banks of each 16-byte chunk")
    for tile in tiles:
        starts = _chunk_starts(tile)
        shown_chunks = min(len(starts[0]), 16)
        cells = [[Cell(_bank_span(a), (a // sm80.CHUNK_BYTES) % 8) for a in row[:shown_chunks]]
                 for row in starts]
        checks = ", ".join(f"{p}: {conflicts(starts, p)} conflicts" for p in tile.phases)
        more = "" if shown_chunks == len(starts[0]) else f" (first {shown_chunks} of {len(starts[0])} chunks)"
        fig.grids.append(Grid(tile.title + more, [f"row {r}" for r in range(tile.rows)],
                              [f"chunk {q}" for q in range(shown_chunks)], cells,
                              f"cell = banks of the chunk; colour = 16-byte bank group; {checks}"))
    fig.notes.append("ldmatrix / stmatrix phase: the 8 row addresses of one 8x8 tile; cp.async / TMA phase: "
                     "8 consecutive 16-byte chunks in row-major order. 0 conflicts = one wavefront each.")
    return fig


# --------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------

BUILDERS: Dict[str, Callable] = {
    "mma": view_mma,
    "ldmatrix": view_ldmatrix,
    "packed": view_packed,
    "remap": view_remap,
    "params": view_params,
    "swizzle": view_swizzle,
}


def add_parser(subparsers, name: str, help_text: str):
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[0])
    views = parser.add_subparsers(dest="view", metavar="VIEW")
    views.required = True
    for view, text in VIEWS.items():
        p = views.add_parser(view, help=text, description=text)
        p.add_argument("--arch", choices=ARCHS, default="sm80", help="instruction configuration (default sm80)")
        p.add_argument("--bits", type=int, choices=BITS, default=4,
                       help="code width of the operand (default 4); a K4V2 cache packs K as --operand k "
                            "--bits 4 and V as --operand v --bits 2 (its 256-token V tile is 2-bit V's own)")
        p.add_argument("--operand", choices=OPERANDS, default="k", help="q, k, p or v (default k)")
        p.add_argument("--k-mode", choices=K_MODES, default="channel",
                       help="K params per channel or per token (default channel)")
        p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp16", help="16-bit type (default fp16)")
        p.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=128, help="D (default 128)")
        p.add_argument("--format", choices=FORMATS, default="int",
                       help="int (4/2-bit codes, every arch) or nvfp4 / mxfp4 (sm100)")
        p.add_argument("--svg", metavar="FILE", type=output_file,
                       help="also write the picture as an SVG file (its folder must exist)")
    return parser


def build(args) -> Figure:
    return BUILDERS[args.view](args)


def run(args) -> int:
    from rich.console import Console

    try:
        fig = build(args)
    except LayoutError as err:
        print_error(f"layout {args.view}: {err}")
        return 2
    if args.svg:  # checked before the picture is drawn: an unwritable path draws nothing
        why = cannot_write(args.svg)
        if why:
            print_error(f"layout {args.view}: --svg {args.svg}: cannot write it ({why})")
            return 2
    console = Console()
    render_rich(fig, console)
    if args.svg:
        try:
            write_whole(args.svg, render_svg(fig))
        except OSError as exc:
            print_error(f"layout {args.view}: --svg {args.svg}: cannot write it ({exc.strerror or exc})")
            return 2
        console.print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from .cli import main

    sys.exit(main(["layout", *sys.argv[1:]]))
