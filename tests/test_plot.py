"""``gradnan report --plot``: the picture lays every rank out by the job's parallel layout and stays
readable from 8 to 16,384 ranks (no text overlaps another or leaves the figure, by matplotlib's own text
extents), and nothing from a file reaches matplotlib or the terminal raw. The run directories are the
synthetic ones of ``gradnan.testing.synthetic``, built in memory (``run_files``: 16,384 ranks in about a
second). benchmarks/plot.py times the drawing."""

from __future__ import annotations

import itertools

import pytest

from gradnan.offline.incident.analysis import analyze
from gradnan.testing.synthetic import coords_of, origin_rank, run_files

matplotlib = pytest.importorskip("matplotlib")

from gradnan.offline.incident.plot import (  # noqa: E402  (matplotlib is an optional extra)
    draw_incident,
    plot_incident,
    plot_title,
)
from gradnan.offline.incident.plot_grid import FINITE, ORIGIN, RECEIVED, parallel_layout  # noqa: E402

SIZES = (8, 4096, 16384)


@pytest.fixture(scope="module")
def reports():
    return {size: analyze(run_files(size)) for size in SIZES}


def text_boxes(figure):
    from matplotlib.text import Text

    figure.canvas.draw()  # as saved: axis labels and ticks take their places when drawn
    renderer = figure.canvas.get_renderer()
    undrawn = {id(label) for axes in figure.axes for axis in (axes.xaxis, axes.yaxis)
               for tick in axis.get_major_ticks() + axis.get_minor_ticks()
               if not axis.get_view_interval().min() <= tick.get_loc() <= axis.get_view_interval().max()
               for label in (tick.label1, tick.label2)}  # matplotlib draws no tick outside the axes' limits
    texts = [text for text in figure.findobj(Text)
             if text.get_visible() and text.get_text().strip() and id(text) not in undrawn]
    return [(text.get_text(), text.get_window_extent(renderer)) for text in texts]


@pytest.mark.parametrize("size", SIZES)
def test_no_text_overlaps_another_or_leaves_the_figure(reports, size):
    figure, _ = draw_incident(reports[size])
    try:
        boxes = text_boxes(figure)
        frame = figure.bbox
        outside = [text for text, box in boxes if box.x0 < frame.x0 - 0.5 or box.y0 < frame.y0 - 0.5
                   or box.x1 > frame.x1 + 0.5 or box.y1 > frame.y1 + 0.5]
        assert not outside
        overlapping = [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
                       if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 0.5
                       and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 0.5]
        assert not overlapping
        assert len(boxes) > 20
    finally:
        matplotlib.pyplot.close(figure)


@pytest.mark.parametrize("size", SIZES)
def test_the_ranks_sit_by_their_parallel_layout(reports, size):
    """pp rows, dp columns, tp across a cell; the origin, its data-parallel peers holding the NaN (the
    collective's row outlined) and every other rank finite; a cell shows its strongest rank once its
    tensor-parallel peers are too narrow to draw (16,384 ranks)."""
    report, origin = reports[size], origin_rank(size)
    figure, drawn = draw_incident(report)
    matplotlib.pyplot.close(figure)
    layout, states = drawn["layout"], drawn["states"]
    coords = coords_of(origin, size)
    assert layout.axes == ("pp", "dp", "tp")
    assert (layout.rows, layout.cols, layout.inner_cols) == (coords["pp_size"], coords["dp_size"],
                                                             coords["tp_size"])
    assert layout.places[origin] == (coords["pp"], coords["dp"], 0, coords["tp"])
    assert len(layout.places) == size and states[origin] == ORIGIN
    received = {rank for rank, state in states.items() if state == RECEIVED}
    assert received == {rank for rank in range(size) if rank != origin
                        and (coords_of(rank, size)["tp"], coords_of(rank, size)["pp"]) == (coords["tp"],
                                                                                             coords["pp"])}
    assert sum(state == FINITE for state in states.values()) == size - 1 - len(received)
    assert drawn["outlined_rows"] == [coords["pp"]]
    assert drawn["pooled"] == (size == 16384)
    assert " ".join(drawn["title"]) == plot_title(report.incident)
    assert "`" not in plot_title(report.incident) and len(drawn["title"]) <= 2
    assert drawn["bars"] and all(value == 0.5 for _, value in drawn["bars"])


def test_the_gradients_are_measured_against_their_dtype_from_the_map(reports):
    [entry] = reports[4096].incident.origin
    assert {param["dtype"] for param in entry["params"]} == {"torch.bfloat16"}


def test_without_coordinates_the_ranks_go_by_number():
    views = [{"global_rank": rank, "tp": 0, "pp": 0, "dp": None} for rank in range(10)]
    layout = parallel_layout(views)
    assert layout.by_number and len(set(layout.places.values())) == 10
    spread = [{"global_rank": rank, "tp": 0, "pp": 0, "dp": rank * 10**6} for rank in range(3)]
    assert parallel_layout(spread).by_number, "coordinates from a file must not size the picture"


def test_context_parallel_peers_get_rows_inside_a_cell():
    views = [{"global_rank": rank, "tp": rank % 2, "cp": rank // 2 % 2, "pp": 0, "dp": rank // 4}
             for rank in range(8)]
    layout = parallel_layout(views)
    assert layout.axes == ("pp", "dp", "tp", "cp") and (layout.inner_rows, layout.inner_cols) == (2, 2)
    assert layout.places[6] == (0, 1, 1, 0)


@pytest.mark.filterwarnings("ignore:Glyph")  # drawn here by the test itself; plot_incident drops them
def test_control_characters_from_a_file_reach_neither_the_picture_nor_the_terminal(tmp_path, capfd):
    """A parameter name and a host with ESC, BEL, a newline, a line separator and a glyph the font lacks:
    drawn escaped on one line, and stderr stays empty (no missing-glyph warning)."""
    files = run_files(8)
    origin = origin_rank(8)
    hostile = "decoder.\x1b]0;pwned\x07x\n\u2028Verdict: hardware\u6f22.weight"
    for records in files.records.values():
        for record in records:
            if record["rank"]["global_rank"] == origin:
                record["rank"]["host"] = "node\x1b[2J"
                for param in record["params"]:
                    param["name"] = hostile
    report = analyze(files)
    figure, drawn = draw_incident(report)
    texts = [text for text, _ in text_boxes(figure)]
    matplotlib.pyplot.close(figure)
    assert not [text for text in texts if any(ord(c) < 0x20 and c != "\n" or 0x7F <= ord(c) < 0xA0
                                              or c == "\u2028" for c in text)]
    assert any("\\x1b]0;pwned\\x07x" in text for text in texts)
    assert [line for text in texts for line in text.split("\n") if line.startswith("Verdict")] == [
        drawn["title"][0]], "no fake headline line"
    capfd.readouterr()
    plot_incident(report, tmp_path / "hostile.svg")
    plot_incident(report, tmp_path / "hostile.png")
    assert capfd.readouterr().err == ""
    assert "\x1b" not in (tmp_path / "hostile.svg").read_text()


@pytest.mark.parametrize("size", SIZES)
def test_the_runup_panel_draws_the_culprit_bucket_on_the_first_rank_in_red_and_the_others_in_grey(reports,
                                                                                                   size):
    runup = reports[size].incident.runup
    assert runup.first_ranks == (origin_rank(size),)
    figure, _ = draw_incident(reports[size])
    try:
        [axes] = [axes for axes in figure.axes if axes.get_ylabel() == "largest |grad|"]
        assert axes.get_yscale() == "log"
        red = [line for line in axes.get_lines()
               if line.get_color() == "#c0392b" and len(line.get_xdata()) > 1]
        [first] = [rank for rank in runup.ranks if rank.grew]
        assert [list(line.get_ydata()) for line in red] == [list(first.values[:-1])]  # the NaN: a mark
        assert list(red[0].get_xdata()) == [step - runup.step for step in first.steps[:-1]]
        others = len(runup.ranks) - 1
        grey_lines = [line for line in axes.get_lines() if line.get_color() == "#999999"]
        assert len(grey_lines) == (others if others <= 8 else 0)
        assert len(axes.collections) == (0 if others <= 8 else 1)  # past 8: one band
    finally:
        matplotlib.pyplot.close(figure)
