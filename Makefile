# The README's two commands: `make run` and `make test`.
.PHONY: setup run test protos

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/tandem up

test: setup
	bash scripts/test.sh

protos: setup
	.venv/bin/python -m tandem.protos.generate
