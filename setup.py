"""The compiled parts: the router's holder-mask table (consumer/router/_masks.c), the Avro
coder of the envelope schema (schemas/_avro.c) and the one pass from vLLM's events to that
Avro (producer/_vllm.c; both write through schemas/_avro_writer.h).

Everything else is declared in pyproject.toml. The extensions are optional: where no C
compiler is found the build goes on, and the router uses its pure-Python table
(kvledger.consumer.router.masks.COMPILED), the codec fastavro alone and the publisher the
vLLM adapter's Python mapping."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvledger.consumer.router._masks",
            ["consumer/router/_masks.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvledger.schemas._avro",
            ["schemas/_avro.c"],
            depends=["schemas/_avro_writer.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvledger.producer._vllm",
            ["producer/_vllm.c"],
            depends=["schemas/_avro_writer.h", "producer/_vllm_packed.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
