#!/bin/sh
echo "bazel coverage is not available offline: the coverage tools are a download; use pytest --cov instead" >&2
exit 1
