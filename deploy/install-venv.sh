#!/bin/sh
# Inside an image build (deploy/Dockerfile): the virtual environment /opt/dart from one image's wheel
# directory (scripts/build-images.sh lays it out): the locked third-party dependencies, hash-checked,
# then the DART wheels without resolving again, then a consistency check. No package index is used.
set -eu
wheels=${1:?usage: install-venv.sh WHEEL_DIR}
python3 -m venv /opt/dart
/opt/dart/bin/pip install --no-index --no-cache-dir --find-links "$wheels/third-party" --require-hashes \
    -r "$wheels/requirements.txt"
/opt/dart/bin/pip install --no-index --no-cache-dir --no-deps "$wheels"/dist/*.whl
/opt/dart/bin/pip check
