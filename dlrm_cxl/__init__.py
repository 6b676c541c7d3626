"""dlrm-cxl: a DLRM trainer whose embedding tables live in a persistent memory pool."""

import logging as _logging


class _NoFxTracingNotice(_logging.Filter):
    """Drops torch's one notice "is_fx_tracing will return true for both fx.symbolic_trace and
    torch.export ..." (torch/fx/_symbolic_trace.py logs it the first time a TorchRec
    KeyedJaggedTensor is made: on every command and every torchrun rank; nothing here traces).
    Every other record of that logger passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


# Before torch or TorchRec is imported by anything of this package (the logger is torch's own,
# by its module name; a filter set now stays when torch configures its logging).
_logging.getLogger("torch.fx._symbolic_trace").addFilter(_NoFxTracingNotice())

# MKL's mode pinned before anything of this package imports TorchRec, whose import runs a GEMM
# (MKL takes its mode at its first call): dlrm_cxl/arithmetic.py.
from .arithmetic import pin_mkl_mode as _pin_mkl_mode  # noqa: E402

_pin_mkl_mode()
