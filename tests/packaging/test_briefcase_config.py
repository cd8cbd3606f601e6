"""The installers' configuration and template (packaging/, [tool.briefcase]), checked with
Briefcase's own parser and cookiecutter: fast, and on every platform's configuration,
macOS included (Briefcase refuses to build a macOS app anywhere but on a Mac)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

briefcase_config = pytest.importorskip("briefcase.config")
from briefcase.console import Console  # noqa: E402
from briefcase.integrations.cookiecutter import PythonVersionExtension  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[2]
APP = "bevy-desktop"


def app_config(platform: str, output_format: str):
    _, apps = briefcase_config.parse_config(
        ROOT / "pyproject.toml", platform=platform, output_format=output_format, console=Console()
    )
    return briefcase_config.DraftAppConfig(**apps[APP])


@pytest.mark.parametrize(("platform", "output_format"), [("macOS", "app"), ("linux", "system")])
def test_configuration_parses_for_each_installer(platform, output_format):
    app = app_config(platform, output_format)
    assert app.formal_name == "Bevy Desktop"
    assert app.bundle_identifier == "org.bevy-desktop.bevy-desktop"
    assert app.module_name == "bevy_desktop"
    # The runtime dependencies are the project's own, pinned the way `make setup` pins them.
    assert "torch==2.13.0" in app.requires and "PySide6-Essentials==6.11.3" in app.requires
    assert not any(r.startswith(("pytest", "ruff", "transformers")) for r in app.requires)
    for source in app.sources:
        assert (ROOT / source).is_dir(), source
    assert app.license == "Apache-2.0"
    for name in app.license_files:
        assert (ROOT / name).is_file(), name
    assert len(app.description) <= 80  # Debian's and Briefcase's limit for the summary line
    for size in (16, 32, 64, 128, 256, 512):
        assert (ROOT / f"{app.icon}-{size}.png").is_file(), size
    if platform == "macOS":
        assert app.min_os_version and app.info["NSHighResolutionCapable"] is True
        assert getattr(app, "template", None) is None  # Briefcase's own, on a Mac
    else:
        assert app.template == "packaging/linux-system"
        # Briefcase requires the changelog beside pyproject.toml and installs it as
        # /usr/share/doc/<app>/changelog.gz.
        assert (ROOT / "CHANGELOG.md").is_file() and (ROOT / app.man_page).is_file()


def render_template(tmp_path: Path) -> Path:
    from cookiecutter.main import cookiecutter

    cookiecutter(
        str(ROOT / "packaging" / "linux-system"),
        no_input=True,
        output_dir=str(tmp_path),
        extra_context={"format": "bookworm", "python_version": "3.11"},
    )
    return tmp_path / "bookworm"


def test_template_renders_the_paths_briefcase_reads(tmp_path):
    import tomllib

    bundle = render_template(tmp_path)
    paths = tomllib.loads((bundle / "briefcase.toml").read_text())["paths"]
    assert paths["app_path"] == f"{APP}-0.1.0/usr/lib/{APP}/app"
    assert paths["app_packages_path"] == f"{APP}-0.1.0/usr/lib/{APP}/app_packages"
    assert set(paths["icon"]) == {"16", "32", "64", "128", "256", "512"}
    desktop = bundle / f"{APP}-0.1.0/usr/share/applications/org.bevy-desktop.{APP}.desktop"
    entry = dict(line.split("=", 1) for line in desktop.read_text().splitlines() if "=" in line)
    assert entry["Exec"] == APP and entry["Icon"] == f"org.bevy-desktop.{APP}"
    assert "{{" not in desktop.read_text()
    overrides = bundle / f"{APP}-0.1.0/usr/share/lintian/overrides/{APP}"
    for line in overrides.read_text().splitlines():
        assert not line or line.startswith(("#", f"{APP}: ")), line


@pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("cc") is None, reason="no C toolchain"
)
def test_launcher_runs_the_entry_isolated_with_a_user_bytecode_cache(tmp_path):
    """The real launcher, built by the template's Makefile, started on a stand-in entry file
    that reports how Python was started."""
    bundle = render_template(tmp_path / "render")
    entry = tmp_path / "entry.py"
    entry.write_text(
        "import json, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'isolated': sys.flags.isolated,\n"
        "  'dont_write': sys.flags.dont_write_bytecode, 'prefix': sys.pycache_prefix,\n"
        "  'executable': sys.executable, 'path0': sys.path[0]}))\n"
    )
    done = subprocess.run(
        ["make", "-C", str(bundle / "bootstrap"), f"PYTHON={sys.executable}", f"ENTRY={entry}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    launcher = bundle / "bootstrap" / APP
    home = tmp_path / "home"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": "/nowhere"}

    import json

    def run(extra_env):
        out = subprocess.run(
            [str(launcher), "chat", "--model", "a b"],
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out)

    seen = run({})
    assert seen["argv"] == ["chat", "--model", "a b"]
    assert seen["isolated"] == 1 and seen["path0"] != "/nowhere"
    assert seen["executable"] == sys.executable  # a real Python for helper processes
    assert seen["prefix"] == str(home / ".cache" / APP / "pycache") and not seen["dont_write"]
    assert run({"XDG_CACHE_HOME": str(tmp_path / "xdg")})["prefix"] == str(
        tmp_path / "xdg" / APP / "pycache"
    )
    # No home to write to: no bytecode written anywhere.
    nohome = subprocess.run(
        [str(launcher)],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(nohome.stdout)["dont_write"] == 1
