#!/bin/sh
# The stack's store before any service writes (a one-shot step, run again at every `up`): as MinIO's
# administrator, the run's bucket ($DART_S3_BUCKET) and one user per store role, dart-<role> with the
# secret DART_S3_<ROLE>_SECRET_KEY, bounded by the policy /etc/dart/s3-policies/<role>.json
# (deploy/s3/policies, generated from the grants table). The roles may not create buckets.
set -eu
mc alias set dart http://s3:9000 "$DART_S3_ADMIN_ACCESS_KEY" "$DART_S3_ADMIN_SECRET_KEY" >/dev/null
mc mb --ignore-existing "dart/$DART_S3_BUCKET"
for path in /etc/dart/s3-policies/*.json; do
    role="$(basename "$path" .json)"
    secret="$(printenv "DART_S3_$(echo "$role" | tr a-z A-Z)_SECRET_KEY")"
    mc admin policy create dart "dart-$role" "$path"
    mc admin user add dart "dart-$role" "$secret"
    # Attaching a policy the user already has is an error to mc: a restarted stack has it from the last run.
    mc admin policy attach dart "dart-$role" --user "dart-$role" \
        || mc admin user info dart "dart-$role" | grep -q "dart-$role"
done
