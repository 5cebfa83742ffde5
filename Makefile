# Inside DeepInfer: every target creates or updates .venv itself.
#   make serve     the book at http://127.0.0.1:8000, rebuilt when docs/, snippets/ or engine/ change
#   make test      install everything, then run the whole test suite
#   make build     mkdocs build --strict
#   make snippets  the whole drift guard: outputs and results, their places on the pages,
#                  the prose's numbers and names, plots, and the edition manifest
#   make regen     rewrite every recorded output, plot and the edition manifest (nothing else writes)
#   make lint      ruff check and ruff format --check
#   make pdf       the site with the whole book as one PDF in it: site/inside-deepinfer.pdf,
#                  and as an EPUB beside it
#   make epub      the whole book as an EPUB, checked by epubcheck: site/inside-deepinfer.epub
#   make mutate    mutation testing of the engine's core modules, and the score per module
#                  (not part of make test; hours on 2 cores for all of them: a module of a few
#                  hundred mutants takes 15 to 30 minutes). One module at a time:
#                  make mutate MUTANTS='engine.kv.store_connector.*'
#                  The survivors judged equivalent are listed in tests/mutation_survivors.md.
#                  After changing pyproject's only_mutate, make clean first: mutmut keeps a
#                  module it copied unmutated before as it was.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build the book's outputs are recorded with. On machines whose pip does
# not see it locally, set TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist); 0 runs the tests in-process. worksteal: a process
# that runs out of tests takes some of another's queue, so that the slowest tests
# do not end the run on one core. On the idle 2-core CI machine, from clean clones,
# pytest took 19 min 02 s with two processes and the same with three (which used
# 6% more CPU time), so two.
TEST_WORKERS ?= 2
TEST_DIST ?= worksteal
# The browser the site test drives. Point it at another Chromium (GitHub's runners
# ship /usr/bin/google-chrome) and nothing is installed.
export CHROMIUM ?= /usr/bin/chromium
# Material prints a notice about MkDocs 2 on every build; the book pins MkDocs 1.
export NO_MKDOCS_2_WARNING := 1

# Pyodide, which runs the standard-library experiments in the reader's browser: from
# the npm registry, into build/, and served by the site itself (docs/hooks/run_in_page.py).
PYODIDE_VERSION ?= 314.0.8
PYODIDE := build/pyodide/.installed-$(PYODIDE_VERSION)

.PHONY: serve build test snippets regen lint chromium redis epubcheck clean pdf epub mutate

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The site alone: what `make serve` and `make build` need, and no torch.
$(VENV)/.docs: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --group docs
	touch $@

# The site and what prints it to PDF (Playwright) and writes the EPUB (ebooklib); no torch.
$(VENV)/.pdf: pyproject.toml $(VENV)/.docs
	$(BIN)/pip install -q --group docs --group pdf
	touch $@

# Everything: the engine (editable), torch, triton, the test-only oracle and tools,
# and the engine's C++ CPU operators, built once here (engine/csrc; they are cached).
$(VENV)/.all: pyproject.toml $(VENV)/.docs
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e . --group docs --group test
	$(BIN)/python -m engine.csrc
	touch $@

serve: $(VENV)/.docs $(PYODIDE)
	SITE_URL=http://127.0.0.1:8000/ $(BIN)/mkdocs serve -a 127.0.0.1:8000

build: $(VENV)/.docs $(PYODIDE)
	$(BIN)/mkdocs build --strict

# npm comes with Node.js; where it is missing and we may (root), Debian's is installed.
# Without it the site still builds, and each Run button gives its command instead.
$(PYODIDE):
	@if ! command -v npm >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null) \
	    || echo "note: could not install npm with apt-get"; \
	fi
	@if command -v npm >/dev/null; then \
	  npm install --no-save --no-audit --no-fund --silent --prefix build/pyodide \
	    pyodide@$(PYODIDE_VERSION) && touch $@; \
	else \
	  echo "note: npm is missing: the site is built without Pyodide, and Run buttons give commands"; \
	fi

# Builds the site into site/ with its print page, and prints that page with
# Chromium to site/inside-deepinfer.pdf, and writes the same pages as
# site/inside-deepinfer.epub, which every page's footer then links.
# A plain `make build` has neither the print page nor the links.
pdf: $(VENV)/.pdf $(PYODIDE) chromium epubcheck
	$(BIN)/python docs/tools/pdf.py --site-dir site
	$(BIN)/python docs/tools/epub.py --site-dir site --built --out site/inside-deepinfer.epub

# The EPUB alone, from a site built in a temporary folder (site/ keeps its pages),
# and epubcheck's verdict on it: an error fails the target.
epub: $(VENV)/.pdf $(PYODIDE) chromium epubcheck
	$(BIN)/python docs/tools/epub.py --check --out site/inside-deepinfer.epub

# Debian's epubcheck (a Java program) validates the EPUB; installed when it is
# missing and we may (root). Elsewhere `make pdf` writes the EPUB unchecked.
epubcheck:
	@if [ ! -e /usr/share/java/epubcheck.jar ] && ! command -v epubcheck >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq epubcheck >/dev/null) \
	      || { echo "error: could not install epubcheck with apt-get"; exit 1; }; \
	  else \
	    echo "note: epubcheck is missing and cannot be installed here; the EPUB is not checked"; \
	  fi; \
	fi

# The browser test drives a system Chromium; install it when it is missing and
# we may (root), as on a fresh CI machine.
chromium:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$(CHROMIUM)" = /usr/bin/chromium ] && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || { echo "error: could not install chromium with apt-get"; exit 1; }; \
	  else \
	    echo "note: $(CHROMIUM) is missing and cannot be installed here; the browser test will fail"; \
	  fi; \
	fi

# The KV store's tests start their own Redis from Debian's redis-server (Chapter 8);
# install it when it is missing and we may (root), as on a fresh CI machine.
redis:
	@if ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	      || { echo "error: could not install redis-server with apt-get"; exit 1; }; \
	  else \
	    echo "note: redis-server is missing and cannot be installed here; the Redis tests will fail"; \
	  fi; \
	fi

test: $(VENV)/.all $(PYODIDE) chromium redis epubcheck
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(if $(filter-out 0,$(TEST_WORKERS)),--dist $(TEST_DIST)) $(PYTEST_ARGS)

# mutmut's settings (the modules, the tests) are [tool.mutmut] in pyproject.toml.
# It keeps its results in mutants/, so a second run redoes only what changed.
MUTANTS ?=
$(VENV)/.mutate: pyproject.toml $(VENV)/.all
	$(BIN)/pip install -q --group mutate
	touch $@

mutate: $(VENV)/.mutate
	-OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/mutmut results --all true | $(BIN)/python tests/mutation_score.py

# Every test that keeps prose, excerpts, outputs and plots in step.
GUARD_TESTS := $(wildcard tests/test_snippets.py tests/test_snippet_sources.py tests/test_results.py \
	tests/test_page_guard.py tests/test_prose.py tests/test_plots.py tests/test_edition.py \
	tests/test_machine_independence.py)

snippets: $(VENV)/.all
	$(BIN)/python -m pytest $(GUARD_TESTS) $(PYTEST_ARGS)

regen: $(VENV)/.all
	$(BIN)/python snippets/_runner.py regen

lint: $(VENV)/.all
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf site build test-artifacts .pytest_cache mutants

# Real clients, unchanged, against `deepinfer serve`: lm-eval-harness (a local JSONL task:
# loglikelihood, multiple choice, generate_until), langchain-openai and LiteLLM
# (tests/server/clients/). Not part of `make test`, which replays the request bodies they
# send (tests/server/client_requests/); `make clients RECORD=1` records those bodies anew.
$(VENV)/.clients: pyproject.toml $(VENV)/.all
	$(BIN)/pip install -q --group clients
	touch $@

.PHONY: clients
clients: $(VENV)/.clients
	DEEPINFER_CLIENTS=1 $(if $(RECORD),DEEPINFER_RECORD_CLIENTS=1) LITELLM_LOCAL_MODEL_COST_MAP=True \
	  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
	  $(BIN)/python -m pytest -n 0 tests/server/clients $(PYTEST_ARGS)
