"""The experimental transports: reached by name through get_transport, offered by no flag of `freescale train`."""

from __future__ import annotations

import importlib

import pytest

from fscomm.transport import BACKENDS, EXPERIMENTAL_BACKENDS, get_transport
from pipelines.cli import main
from pipelines.job.config.sections import TRANSPORT_CHOICES


def test_each_experimental_backend_lives_in_fscomm_experimental_and_apart_from_the_offered_ones():
    assert sorted(EXPERIMENTAL_BACKENDS) == ["nccl-ce", "peer"]
    assert not set(EXPERIMENTAL_BACKENDS) & (set(BACKENDS) | set(TRANSPORT_CHOICES))
    for path in EXPERIMENTAL_BACKENDS.values():
        module, cls = path.split(":")
        assert module.startswith("fscomm.experimental.")
        assert callable(getattr(importlib.import_module(module), cls).unavailable_reason)


def test_an_unknown_name_lists_the_offered_and_the_experimental_ones():
    with pytest.raises(ValueError) as error:
        get_transport("nvlink")
    assert str(error.value) == (
        "get_transport: unknown transport 'nvlink'; choose one of ['host', 'host-shm', 'host-tcp', 'nccl', 'rdma']"
        " (experimental: nccl-ce, peer)"
    )


@pytest.mark.parametrize("name", sorted(EXPERIMENTAL_BACKENDS))
def test_freescale_train_refuses_an_experimental_transport_in_one_line(name, capsys):
    assert main(["train", "--transport", name]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"freescale train: error: transport must be one of host, host-shm, host-tcp, nccl, rdma, got '{name}'"
        " (--transport)"
    ]
