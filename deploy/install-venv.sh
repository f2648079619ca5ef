#!/bin/sh
# Inside an image build (deploy/Dockerfile): the virtual environment /opt/dart from one image's wheel
# directory, served by scripts/build-images.sh at WHEELS_URL: the locked third-party dependencies,
# hash-checked, then the named DART packages without resolving again, then a consistency check. No
# package index is used and no wheel stays in the image.
set -eu
url=${1:?usage: install-venv.sh WHEELS_URL PACKAGE...}
shift
python3 -m venv /opt/dart
/opt/dart/bin/pip install --no-index --no-cache-dir --find-links "$url/third-party/" --require-hashes \
    -r "$url/requirements.txt"
/opt/dart/bin/pip install --no-index --no-cache-dir --no-deps --find-links "$url/dist/" "$@"
/opt/dart/bin/pip check
