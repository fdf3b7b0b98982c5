"""``bench/attribute_samples.py``: samples into the step windows, and bad inputs refused.

The tool reads what ``perf script`` prints and what ``bench_vllm.py --windows``
writes; these tests feed it both shapes by hand (no perf run: its timings
would not belong in a test) and check where each sample lands.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "attribute_samples.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("attribute_samples", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tool = _module()


def _write(tmp_path: Path, windows: object) -> Path:
    path = tmp_path / "windows.json"
    path.write_text(json.dumps(windows))
    return path


def test_perf_script_lines_are_parsed_and_junk_is_skipped() -> None:
    lines = [
        "33454.073365:      7f7af710175b _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)\n",
        "  33454.074515:  ffffffff82250979 _raw_spin_unlock_irqrestore ([kernel.kallsyms])\n",
        "33454.075823:      7f7af7100000 [unknown] (/tmp/anon)\n",
        "33454.075900: \n",  # no ip nor symbol (perf script without ip,sym): skipped
        "not a sample line\n",
        "abc: 1 f (x)\n",
    ]
    got = list(tool.parse_perf_script(lines))
    assert got == [
        (33454073365000, "_PyEval_EvalFrameDefault", "libpython3.11.so.1.0"),
        (33454074515000, "_raw_spin_unlock_irqrestore", "[kernel.kallsyms]"),
        (33454075823000, "[unknown]", "anon"),
    ]


def test_each_sample_goes_to_the_side_whose_window_holds_it(tmp_path: Path) -> None:
    # native steps at 0-10 and 40-50, elastic at 20-30 and 60-75 (one thread, in turn)
    path = _write(tmp_path, {"native": [[0, 10], [40, 50]], "elastic": [[20, 30], [60, 75]]})
    windows = tool.load_windows(path)
    assert windows.window_ns == {"native": 20, "elastic": 25}
    samples = [
        (0, "f", "lib"),  # the first instant of a window
        (10, "f", "lib"),  # its last
        (11, "g", "lib"),  # between windows: nobody's
        (25, "f", "lib"),
        (61, "h", "[kernel.kallsyms]"),
        (75, "h", "[kernel.kallsyms]"),
        (76, "h", "[kernel.kallsyms]"),  # after the last window
        (-5, "f", "lib"),  # before the first
    ]
    result = tool.attribute(windows, samples)
    assert result.by_dso["native"] == {"lib": 2}
    assert result.by_dso["elastic"] == {"lib": 1, "[kernel.kallsyms]": 2}
    assert result.by_symbol["elastic"]["h  ([kernel.kallsyms])"] == 2
    assert "g  (lib)" not in result.by_symbol["native"] + result.by_symbol["elastic"]


@pytest.mark.parametrize(
    ("windows", "message"),
    [
        ({"native": [[0, 1]]}, "no windows for ['elastic']"),
        ({"native": [[0, 1]], "elastic": []}, "1 native and 0 elastic calls"),
        ({"native": [[0, 10]], "elastic": [[5, 20]]}, "windows overlap at 5 ns"),
    ],
)
def test_windows_that_cannot_be_one_lockstep_run_are_refused(
    tmp_path: Path, windows: object, message: str
) -> None:
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        tool.load_windows(_write(tmp_path, windows))


def test_a_file_that_is_not_json_is_refused_with_what_to_run(tmp_path: Path) -> None:
    path = tmp_path / "windows.json"
    path.write_text("perf.data, not windows")
    with pytest.raises(SystemExit, match="write one with bench_vllm.py --windows"):
        tool.load_windows(path)
