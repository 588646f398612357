#!/usr/bin/env bash
# Renders a run's report.html in headless Chromium to a PNG, to see the page as a person does.
#   scripts/screenshot_report.sh runs/demo docs/report.png
# Needs Chromium (Debian: apt-get install chromium). Flags keep it off the network and off the GPU.
set -euo pipefail
run_dir=${1:?usage: screenshot_report.sh RUN_DIR OUT.png}
out=${2:?usage: screenshot_report.sh RUN_DIR OUT.png}
page="$(cd "$run_dir/evaluate" && pwd)/report.html"
[ -f "$page" ] || { echo "error: $page not found: run the pipeline (make demo) first" >&2; exit 2; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "error: no Chromium found: apt-get install chromium" >&2; exit 2; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars \
  --window-size=1100,2000 --screenshot="$(realpath -m "$out")" "file://$page" >/dev/null 2>&1
echo "screenshot: $out"
