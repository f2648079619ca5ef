#!/bin/sh
# The offline stack's S3 store: SeaweedFS (master, volume server, filer and S3 gateway in one process)
# serving S3 on :9000 with one identity whose keys come from DART_S3_ACCESS_KEY / DART_S3_SECRET_KEY.
# Everything it keeps (metadata, filer store, object bytes) is under /data, the s3-data volume.
set -eu
mkdir -p /data/meta
cd /data
# One volume per collection (every bucket is one) instead of seven.
printf '[master.volume_growth]\ncopy_1 = 1\n' > master.toml
python3 - > /tmp/s3.json <<'PY'
import json, os
keys = {"accessKey": os.environ["DART_S3_ACCESS_KEY"], "secretKey": os.environ["DART_S3_SECRET_KEY"]}
actions = ["Admin", "Read", "List", "Tagging", "Write"]
print(json.dumps({"identities": [{"name": "dart", "credentials": [keys], "actions": actions}]}))
PY
chmod 600 /tmp/s3.json
exec weed server -dir=/data/meta -ip=127.0.0.1 -ip.bind=0.0.0.0 \
    -master.telemetry=false -master.volumeSizeLimitMB=64 -volume.max=100 \
    -filer -s3 -s3.port=9000 -s3.port.iceberg=0 -s3.port.lance=0 -s3.config=/tmp/s3.json
