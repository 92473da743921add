"""The command line's front matter: the top-level help, quiet by default (known third-party warnings and
prints filtered, by message only) and --verbose (the package's INFO log, nothing filtered)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from nvalchemi_jaxbridge.app import quiet
from nvalchemi_jaxbridge.app.cli import main


def test_top_level_help_says_what_the_commands_do(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "thin calls" not in text and "layers" not in text
    assert "run MD of a demo potential, your op or an MLIP" in text


def _emit_known():
    warnings.warn("`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`.",
                  FutureWarning)
    warnings.warn("The TorchScript type system doesn't support instance-level annotations on empty non-base "
                  "types in `__init__`.", UserWarning)
    warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the`weights_only` "
                  "argument was not explicitly passed to `torch.load`, forcing weights_only=False.", UserWarning)
    warnings.warn("a warning of the user's own that must stay", UserWarning)
    warnings.warn("`torch.jit.script` is deprecated", UserWarning)  # known words, another category: stays
    print("cuequivariance or cuequivariance_torch is not available. Cuequivariance acceleration will be disabled.")
    print("a line of the user's own")


def test_known_third_party_noise_is_filtered_by_message_and_nothing_else(capsys, caplog):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="nvalchemi_jaxbridge"), quiet.cli_output(verbose=False):
            _emit_known()
    assert [str(w.message) for w in seen] == ["a warning of the user's own that must stay",
                                              "`torch.jit.script` is deprecated"]
    assert capsys.readouterr().out == "a line of the user's own\n"
    assert "third-party message: cuequivariance" in caplog.text  # moved to the INFO log, not dropped


def test_verbose_filters_nothing_and_shows_our_info_lines(capsys):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet.cli_output(verbose=True):
            _emit_known()
            logging.getLogger("nvalchemi_jaxbridge.layout.halo_plan").info("capacities grown: ghost rows")
    assert len(seen) == 5
    captured = capsys.readouterr()
    assert "cuequivariance" in captured.out and "a line of the user's own" in captured.out
    assert "INFO nvalchemi_jaxbridge.layout.halo_plan: capacities grown: ghost rows" in captured.err
    assert logging.getLogger("nvalchemi_jaxbridge").level == logging.NOTSET  # restored afterwards


@pytest.mark.slow
def test_building_a_mace_model_under_the_cli_filter_warns_nothing():
    pytest.importorskip("mace", reason="needs mace-torch: pip install 'nvalchemi_jaxbridge[mlip]'")
    code = (
        "import warnings, torch\n"
        "from nvalchemi_jaxbridge.app.quiet import cli_output\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    with cli_output(verbose=False):\n"
        "        from nvalchemi_jaxbridge.mlip.mace import random_mace\n"
        "        random_mace((29, 79), seed=0, dtype=torch.float64, max_ell=2)\n"
        "print('WARNINGS', len(seen), [str(w.message)[:80] for w in seen])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "WARNINGS 0 []" in out, out
    assert "cuequivariance" not in out


def test_the_guide_lists_every_filtered_warning_and_print():
    import pathlib

    guide = " ".join((pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text().split())
    for _, message, _ in quiet.KNOWN_WARNINGS:
        assert message.replace("\\", "") in guide, message
    for line, _ in quiet.KNOWN_PRINTS:
        assert line.replace("\\", "").split(".")[0] in guide, line
