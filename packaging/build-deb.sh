#!/usr/bin/env bash
# `make package`: build dist/bevy-desktop_<version>-1~<vendor>-<codename>_<arch>.deb
# offline with Briefcase and our own template (packaging/linux-system).
#
# Briefcase builds Linux system packages with the system Python (/usr/bin/python3): the
# package's compiled dependencies must match the interpreter it will run on. So it runs
# from its own venv on that Python, apart from the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

BRIEFCASE_VERSION=0.4.7
VENV=build/briefcase-venv
APP=bevy-desktop
# What Briefcase checks for on Debian (python3-dev, build-essential), the venv for itself,
# and what the launcher's Makefile uses (dpkg-buildflags is in dpkg-dev).
DEBS=(python3-dev python3-venv build-essential dpkg-dev)

log() { printf '\n== %s\n' "$*" >&2; }
start=$(date +%s)

if ! command -v dpkg >/dev/null || ! command -v apt-get >/dev/null; then
    echo "build-deb: needs a Debian or Ubuntu machine (dpkg and apt-get)" >&2
    exit 1
fi
# Briefcase also checks that the package's own runtime dependencies are installed here.
mapfile -t runtime < <(/usr/bin/python3 -c '
import tomllib
app = tomllib.load(open("pyproject.toml", "rb"))["tool"]["briefcase"]["app"]["bevy-desktop"]
print("\n".join(app["linux"]["system"]["debian"]["system_runtime_requires"]))')
((${#runtime[@]})) || { echo "build-deb: could not read the runtime dependencies from pyproject.toml" >&2; exit 1; }
missing=()
for pkg in "${DEBS[@]}" "${runtime[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "Installing build dependencies: ${missing[*]}"
    sudo=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null || { echo "build-deb: run as root, or install: ${missing[*]}" >&2; exit 1; }
        sudo=(sudo)
    fi
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}"
fi

if [[ ! -x $VENV/bin/briefcase ]] || ! "$VENV/bin/briefcase" --version 2>/dev/null | grep -q "$BRIEFCASE_VERSION"; then
    log "Briefcase $BRIEFCASE_VERSION in $VENV (system Python $(/usr/bin/python3 -V))"
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "briefcase==$BRIEFCASE_VERSION"
fi
briefcase() { "$VENV/bin/briefcase" "$@" --no-input; }

# A clean bundle each time: a stale one could ship files the sources no longer have.
rm -rf "build/$APP"
log "briefcase create (app sources, dependencies from PyPI or the local wheel cache)"
briefcase create linux system
log "briefcase build (launcher, docs, permissions)"
briefcase build linux system

# Tidy what pip installed the way Debian expects of a package (lintian's checks):
# console scripts whose #! names this build's venv go (the app runs none of them); only
# ELF programs stay executable (not shared libraries, data or Python files). Libraries
# are left unstripped: strip breaks those auditwheel patched (numpy's OpenBLAS fails to
# load), and would save only about 100 MB of 1 GB.
root=$(find "build/$APP" -mindepth 3 -maxdepth 3 -type d -name "$APP-*" | head -n1)
packages="$root/usr/lib/$APP/app_packages"
[[ -n $root && -d $packages ]] || { echo "build-deb: no bundle under build/$APP (did briefcase create fail?)" >&2; exit 1; }
log "Tidying $packages"
rm -rf "$packages/bin"
find "$packages" -type f -perm /111 -print0 | while IFS= read -r -d '' f; do
    if [[ $(head -c4 "$f" | od -An -c | tr -d ' ') != '177ELF' || $f == *.so || $f == *.so.* ]]; then
        chmod a-x "$f"
    fi
done

log "briefcase package (dpkg-deb)"
briefcase package linux system --adhoc-sign

deb=$(ls -t dist/"${APP}"_*.deb | head -n1)
log "Built $deb: $(du -h "$deb" | cut -f1) (installed: $(du -sh "$root" | cut -f1)) in $(( $(date +%s) - start )) s"
