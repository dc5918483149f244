#!/bin/bash
# The Ascend image's entry point: CANN's environment (the libraries, pyACL on PYTHONPATH, the
# operator paths), then `duomo` with the container's arguments.
set -e
for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnrt/set_env.sh; do
    if [ -f "$env" ]; then
        # shellcheck disable=SC1090
        . "$env"
        break
    fi
done
exec duomo "$@"
