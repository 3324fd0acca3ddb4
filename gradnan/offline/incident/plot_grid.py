"""The incident picture's left column: every rank placed by the job's parallel layout (``parallel_layout``,
or by rank number where the records do not allow it), coloured by its state at the failing step
(``rank_states``), drawn as a grid with the origin ringed and named and the data-parallel collective's
path outlined, then its legend.

Apart from ``plot`` because placing up to tens of thousands of ranks (pooling cells too narrow to see,
choosing which ticks to label) is its own problem, decided from coordinates read from files, which are not
trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...formats.layout import AXES, rank_label, rank_ranges
from .module_table import ROLE_TEXT, rank_role
from .plot_blocks import (
    CHAR_WIDTH,
    DPI,
    GRID_LEFT_IN,
    GRID_WIDTH_IN,
    MARGIN_IN,
    TICK_SPACE_IN,
    WIDTH_IN,
    Block,
    _inches_to_figure,
    _line_height,
    text_block,
    wrapped,
)
from .verdict import Incident, View

NO_RANK, NO_RECORD, FINITE, RECEIVED, ORIGIN = range(5)  # a cell's state; a pooled cell shows the largest
COLOURS = ("#ffffff", "#7f7f7f", "#dddddd", "#f39c12", "#c0392b")
ORIGIN_RING = "#000000"
OUTLINE = "#7a3e00"
MIN_PIXELS = 3  # a tensor-parallel peer narrower than this: cells show their strongest state


@dataclass(frozen=True)
class Layout:
    """Where each rank is drawn: ``places`` maps a global rank to (row, column, row in the cell, column in
    the cell). By the parallel layout (``axes``: row, column, in-cell column, in-cell rows) where every
    rank has its coordinates; else by rank number (``axes`` empty)."""

    axes: Tuple[str, ...]
    rows: int
    cols: int
    inner_rows: int
    inner_cols: int
    places: Dict[int, Tuple[int, int, int, int]]

    @property
    def by_number(self) -> bool:
        return not self.axes


def _coordinate(view: View, axis: str) -> Optional[int]:
    value = view.get(axis, 0 if axis in ("cp", "ep") else None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _varying_inside_cells(views: Sequence[View]) -> Tuple[str, ...]:
    """The context/expert-parallel axes that tell apart ranks of one (pp, dp, tp) position: they get rows
    inside a cell; an axis that follows from the others (expert parallelism within data parallelism) none."""
    varying = []
    for axis in ("cp", "ep"):
        seen: Dict[Tuple[Optional[int], ...], Optional[int]] = {}
        for view in views:
            key = tuple(_coordinate(view, other) for other in ("pp", "dp", "tp"))
            if seen.setdefault(key, _coordinate(view, axis)) != _coordinate(view, axis):
                varying.append(axis)
                break
    return tuple(varying)


def _by_number(ranks: Sequence[int]) -> Layout:
    """Rows of ranks in number order, about twice as wide as tall."""
    count = len(ranks)
    cols = max(1, min(count, math.ceil(math.sqrt(2 * count))))
    return Layout((), math.ceil(count / cols), cols, 1, 1,
                  {rank: (index // cols, index % cols, 0, 0) for index, rank in enumerate(ranks)})


def parallel_layout(views: Sequence[View]) -> Layout:
    """The grid of pipeline stages x data-parallel replicas, tensor-parallel peers across a cell (and
    context/expert-parallel ones down it where they vary within it); by rank number where a rank lacks a
    coordinate, two ranks share one place, or the coordinates would spread them over far more cells than
    there are ranks (coordinates from a file are not trusted)."""
    ranks = [view["global_rank"] for view in views]
    axes = ("tp", "pp", "dp", "cp", "ep")
    known = [{axis: value for axis in axes if (value := _coordinate(view, axis)) is not None}
             for view in views]  # each view's coordinates that are known
    if any(len(coordinates) < len(axes) for coordinates in known):
        return _by_number(ranks)
    inner = _varying_inside_cells(views)
    sizes = {axis: 1 + max(coordinates[axis] for coordinates in known) for axis in ("tp", "pp", "dp", *inner)}
    inner_rows = math.prod(sizes[axis] for axis in inner)
    if sizes["pp"] * sizes["dp"] * sizes["tp"] * inner_rows > 4 * len(views) + 64:
        return _by_number(ranks)
    places = {}
    for view, coordinates in zip(views, known):
        inner_row = 0
        for axis in inner:
            inner_row = inner_row * sizes[axis] + coordinates[axis]
        places[view["global_rank"]] = (coordinates["pp"], coordinates["dp"], inner_row, coordinates["tp"])
    if len(set(places.values())) < len(places):
        return _by_number(ranks)
    return Layout(("pp", "dp", "tp", *inner), sizes["pp"], sizes["dp"], inner_rows, sizes["tp"], places)


def rank_states(incident: Incident) -> Dict[int, int]:
    """Each known rank's state at the failing step, as the analysis decided it."""
    states = {view["global_rank"]: NO_RECORD for view in incident.silent}
    states.update((view["global_rank"], RECEIVED if view.get("holds_nonfinite") else FINITE)
                  for view in incident.receivers)
    states.update((entry["global_rank"], ORIGIN) for entry in incident.origin)
    return states


def _views(incident: Incident) -> List[View]:
    """Every known rank once (an origin rank with several bucket groups appears once per group)."""
    unique: Dict[int, View] = {}
    for view in (*incident.origin, *incident.receivers, *incident.silent):
        unique.setdefault(view["global_rank"], view)
    return list(unique.values())


def _grid_pixels(layout: Layout, height_in: float) -> Tuple[float, float]:
    """The width and height in pixels of one rank's place, unpooled."""
    return (GRID_WIDTH_IN * DPI / (layout.cols * layout.inner_cols),
            height_in * DPI / (layout.rows * layout.inner_rows))


def grid_image(layout: Layout, states: Dict[int, int], pooled: bool):
    """The picture's array: a pixel per rank; ``pooled``: a pixel per cell, its strongest rank's state."""
    import numpy

    image = numpy.zeros((layout.rows, layout.inner_rows, layout.cols, layout.inner_cols), dtype=numpy.int8)
    for rank, (row, col, inner_row, inner_col) in layout.places.items():
        image[row, inner_row, col, inner_col] = states.get(rank, NO_RANK)
    if pooled:
        return image.max(axis=(1, 3))
    return image.reshape(layout.rows * layout.inner_rows, layout.cols * layout.inner_cols)


def _ticks(count: int, length_in: float, size: float, widest: int, marked: Sequence[int]) -> List[int]:
    """Positions to label along an axis of ``count`` cells, ``length_in`` long, labels ``widest``
    characters wide at ``size`` points (1 for the height of a vertical axis' labels): every k-th, and the
    ``marked`` ones (the origin's) with no neighbour closer than k."""
    room = length_in * 72 / (size * (CHAR_WIDTH * widest + 0.8))
    stride = max(1, math.ceil(count / max(1.0, room)))
    chosen = sorted(set(marked))
    for position in range(0, count, stride):
        if all(abs(position - other) >= stride for other in chosen):
            chosen.append(position)
    return sorted(chosen)


def _place(layout: Layout, rank: int, pooled: bool) -> Tuple[float, float]:
    """The centre of a rank's place, in cell units (x, y)."""
    row, col, inner_row, inner_col = layout.places[rank]
    if pooled:
        return col + 0.5, row + 0.5
    return col + (inner_col + 0.5) / layout.inner_cols, row + (inner_row + 0.5) / layout.inner_rows


def grid_height(layout: Layout) -> float:
    return min(4.2, max(1.2, 0.3 * layout.rows * layout.inner_rows))


def grid_block(incident: Incident, layout: Layout, states: Dict[int, int]) -> Tuple[Block, Dict[str, Any]]:
    height = grid_height(layout)
    width, tall = _grid_pixels(layout, height)
    pooled = width < MIN_PIXELS or tall < MIN_PIXELS
    origin = [rank for rank, state in states.items() if state == ORIGIN and rank in layout.places]
    peers = [view for view in incident.receivers if view.get("holds_nonfinite")
             and rank_role(view, list(incident.origin)) == "dp_peer"]
    outlined = sorted({layout.places[rank][0] for rank in origin}) if peers and not layout.by_number else []
    drawn = {"pooled": pooled, "outlined_rows": outlined}

    def draw(figure, left: float, top: float) -> None:
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Rectangle

        axes = figure.add_axes(_inches_to_figure(figure, GRID_LEFT_IN, top, GRID_WIDTH_IN, height))
        axes.imshow(grid_image(layout, states, pooled), cmap=ListedColormap(COLOURS), vmin=0,
                    vmax=len(COLOURS) - 1, aspect="auto", interpolation="nearest",
                    extent=(0, layout.cols, layout.rows, 0))
        if GRID_WIDTH_IN * DPI / layout.cols >= 4:
            axes.vlines(range(1, layout.cols), 0, layout.rows, colors="white", linewidth=1)
        if height * DPI / layout.rows >= 4:
            axes.hlines(range(1, layout.rows), 0, layout.cols, colors="white", linewidth=1.5)
        origin_cells = [layout.places[rank] for rank in origin]
        row_name, col_name = ("pp", "dp") if not layout.by_number else ("r", "+")
        cols = _ticks(layout.cols, GRID_WIDTH_IN, 8, len(f"{col_name}{layout.cols}") + 1,
                      [cell[1] for cell in origin_cells])
        rows = _ticks(layout.rows, height, 8, 1, [cell[0] for cell in origin_cells])
        axes.set_xticks([col + 0.5 for col in cols],
                        [f"{col_name}{col}" for col in cols], fontsize=8)
        axes.set_yticks([row + 0.5 for row in rows],
                        [f"{row_name}{row * (layout.cols if layout.by_number else 1)}" for row in rows],
                        fontsize=8)
        for label, col in zip(axes.get_xticklabels(), cols):
            if col in {cell[1] for cell in origin_cells}:
                label.set_color(COLOURS[ORIGIN])
        for label, row in zip(axes.get_yticklabels(), rows):
            if row in {cell[0] for cell in origin_cells}:
                label.set_color(COLOURS[ORIGIN])
        axes.tick_params(length=2)
        if layout.by_number:
            axes.set_xlabel("ranks by number (the records lack a parallel layout): row start + column",
                            fontsize=9)
        else:
            axes.set_xlabel("data-parallel replica (dp)", fontsize=9)
            axes.set_ylabel("pipeline stage (pp)", fontsize=9)
        named = not pooled and _name_places(axes, layout, states, height)
        if not pooled:
            _separate_peers(axes, layout, height)
        place_pt = max(GRID_WIDTH_IN / layout.cols / (1 if pooled else layout.inner_cols),
                       height / layout.rows / (1 if pooled else layout.inner_rows)) * 72
        for rank in origin:
            x, y = _place(layout, rank, pooled)
            axes.plot([x], [y], marker="o", markersize=min(40.0, max(20.0, 1.5 * place_pt)),
                      markerfacecolor="none", markeredgecolor=ORIGIN_RING, markeredgewidth=1.8, clip_on=False)
        if origin and not named:
            _point_at_origin(axes, layout, origin[0], pooled, height)
        for row in outlined:
            axes.add_patch(Rectangle((0, row), layout.cols, 1, fill=False, edgecolor=OUTLINE, linewidth=2,
                                     linestyle="--", clip_on=False))
            axes.text(layout.cols, row + 0.5, "  data-parallel\n  all-reduce", fontsize=8, va="center",
                      ha="left", color=OUTLINE)
    return Block(height + TICK_SPACE_IN, draw), drawn


def _separate_peers(axes, layout: Layout, height: float) -> None:
    """Thin lines between the peers inside a cell, where they are wide enough to tell apart."""
    if layout.inner_cols > 1 and GRID_WIDTH_IN * DPI / (layout.cols * layout.inner_cols) >= 8:
        axes.vlines([col + inner / layout.inner_cols for col in range(layout.cols)
                     for inner in range(1, layout.inner_cols)], 0, layout.rows, colors="white", linewidth=0.6)
    if layout.inner_rows > 1 and height * DPI / (layout.rows * layout.inner_rows) >= 8:
        axes.hlines([row + inner / layout.inner_rows for row in range(layout.rows)
                     for inner in range(1, layout.inner_rows)], 0, layout.cols, colors="white", linewidth=0.6)


def _name_places(axes, layout: Layout, states: Dict[int, int], height: float) -> bool:
    """Each rank's number inside its place, where every place has room for the widest; whether it did."""
    width_pt = GRID_WIDTH_IN * 72 / (layout.cols * layout.inner_cols)
    height_pt = height * 72 / (layout.rows * layout.inner_rows)
    widest = max(len(f"rank {rank}") for rank in layout.places)
    if widest * 8 * CHAR_WIDTH + 6 > width_pt or _line_height(8) * 72 + 4 > height_pt:
        return False
    for rank in layout.places:
        x, y = _place(layout, rank, False)
        axes.text(x, y, f"rank {rank}", fontsize=8, ha="center", va="center",
                  color="white" if states.get(rank) in (ORIGIN, NO_RECORD) else "black")
    return True


def _point_at_origin(axes, layout: Layout, rank: int, pooled: bool, height: float) -> None:
    """"origin: rank N" above the origin's place (below it on the top row), an arrow to it; aligned so that
    it stays inside the grid wherever the origin is."""
    x, y = _place(layout, rank, pooled)
    row_height_pt = height * 72 / layout.rows
    above = layout.places[rank][0] > 0
    offset = (0.5 * row_height_pt + 12) * (1 if above else -1)
    side = x / layout.cols
    align = "left" if side < 0.25 else "right" if side > 0.75 else "center"
    axes.annotate(f"origin: rank {rank}", (x, y), xytext=(0, offset), textcoords="offset points",
                  fontsize=9, fontweight="bold", ha=align, va="bottom" if above else "top", color=ORIGIN_RING,
                  bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": ORIGIN_RING,
                        "linewidth": 0.8},
                  arrowprops={"arrowstyle": "-|>", "color": ORIGIN_RING, "linewidth": 1.2,
                              "shrinkB": 9})


def layout_caption(layout: Layout) -> str:
    count = len(layout.places)
    if layout.by_number:
        return f"{count:,} rank(s), by rank number"
    down = f", {' x '.join(layout.axes[3:])} down ({layout.inner_rows} rows)" if layout.axes[3:] else ""
    return (f"{count:,} rank(s): pp{layout.rows} x dp{layout.cols} cells, tp{layout.inner_cols} across"
            f" each{down}")


def legend_blocks(incident: Incident, states: Dict[int, int], outlined: bool) -> List[Block]:
    """A swatch and a line (or two) per state: who, how many, how it got there."""
    width = GRID_LEFT_IN + GRID_WIDTH_IN - MARGIN_IN - 0.3
    origin = list(incident.origin)
    counts = {state: sum(1 for value in states.values() if value == state) for state in range(len(COLOURS))}
    first = origin[0] if origin else None
    named = (rank_label(first, "after", [axis for axis in AXES if axis in first]) if first else "none found")
    more = f"; and {counts[ORIGIN] - 1} more: {rank_ranges([e['global_rank'] for e in origin[1:]])}" \
        if counts[ORIGIN] > 1 else ""
    holders = [view for view in incident.receivers if view.get("holds_nonfinite")]
    roles: Dict[str, int] = {}
    for view in holders:
        role = rank_role(view, origin)
        roles[role] = roles.get(role, 0) + 1
    received = "; ".join(f"{count} {ROLE_TEXT[role]}"
                         + (", through the data-parallel all-reduce (outlined)"
                            if role == "dp_peer" and outlined else "") for role, count in roles.items())
    entries = [(ORIGIN, f"origin ({incident.origin_basis.description}), ringed: {named}{more}"),
               (RECEIVED, f"received, holding the NaN/Inf: {counts[RECEIVED]:,} rank(s)"
                          + (f": {received}" if received else "")),
               (FINITE, f"own gradients finite (only the norm was non-finite): {counts[FINITE]:,} rank(s)"),
               (NO_RECORD, f"no record at this step (finite norm, or died first): {counts[NO_RECORD]:,}"
                           " rank(s)")]
    blocks = []
    for state, text in entries:
        lines = wrapped(text, width, 9)
        block = text_block(lines, 9, width)

        def draw(figure, left: float, top: float, state=state, block=block) -> None:
            from matplotlib.patches import Rectangle

            figure.patches.append(Rectangle(
                ((left) / WIDTH_IN, 1 - (top + 0.17) / figure.get_figheight()), 0.17 / WIDTH_IN,
                0.15 / figure.get_figheight(), transform=figure.transFigure, facecolor=COLOURS[state],
                edgecolor="#444444", linewidth=0.6))
            block.draw(figure, left + 0.3, top)
        blocks.append(Block(block.height, draw))
    return blocks
