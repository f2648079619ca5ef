#!/bin/sh
# The offline stack's S3 store: SeaweedFS (master, volume server, filer and S3 gateway in one process)
# serving S3 on :9000. Identities: the administrator (DART_S3_ADMIN_ACCESS_KEY / DART_S3_ADMIN_SECRET_KEY,
# used only by the s3-setup step) and one per store role, dart-<role> with the secret DART_S3_<ROLE>_SECRET_KEY,
# bounded by the IAM policy in /etc/dart/s3-policies/<role>.json (deploy/s3/policies, generated from the
# grants table). Every SeaweedFS port is on the container's loopback (the master, volume server and filer
# take no S3 credentials, the gateway's gRPC port updates identities): s3-gateway.py forwards :9000 to the
# S3 API alone.
# Everything it keeps (metadata, filer store, object bytes) is under /data, the s3-data volume.
set -eu
mkdir -p /data/meta
cd /data
# One volume per collection (every bucket is one) instead of seven.
printf '[master.volume_growth]\ncopy_1 = 1\n' > master.toml
umask 077   # s3.json holds every secret
python3 - > /tmp/s3.json <<'PY'
import json, os, pathlib

def identity(name, access, secret, **grants):
    return {"name": name, "credentials": [{"accessKey": access, "secretKey": secret}], **grants}

admin = ["Admin", "Read", "List", "Tagging", "Write"]
identities = [identity("admin", os.environ["DART_S3_ADMIN_ACCESS_KEY"], os.environ["DART_S3_ADMIN_SECRET_KEY"], actions=admin)]
policies = []
for path in sorted(pathlib.Path("/etc/dart/s3-policies").glob("*.json")):
    role = path.stem
    secret = os.environ[f"DART_S3_{role.upper()}_SECRET_KEY"]
    identities.append(identity(role, f"dart-{role}", secret, actions=[], policyNames=[f"dart-{role}"]))
    policies.append({"name": f"dart-{role}", "content": path.read_text()})
print(json.dumps({"identities": identities, "policies": policies}))
PY
exec python3 /etc/dart/s3-gateway.py 9000 8333 -- weed server -dir=/data/meta -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.telemetry=false -master.volumeSizeLimitMB=64 -volume.max=100 \
    -filer -s3 -s3.port=8333 -s3.port.iceberg=0 -s3.port.lance=0 -s3.config=/tmp/s3.json
