"""The compiled parts: the router's holder-mask table (consumer/router/_masks.c) and the
Avro decoder of the envelope schema (schemas/_avro.c).

Everything else is declared in pyproject.toml. Both extensions are optional: where no C
compiler is found the build goes on, and the router uses its pure-Python table
(kvledger.consumer.router.masks.COMPILED) and the codec fastavro alone."""

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
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
