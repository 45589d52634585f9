"""The doctor: the standalone wiring test (accuracy in isolation, layout sweep, capture
drift, alignment, predicted vs measured acceptance, serving lint) as a product."""

from eaglewire.doctor.report import Check, DoctorReport
from eaglewire.doctor.config import DoctorConfig
from eaglewire.doctor.run import run_doctor

__all__ = ["Check", "DoctorConfig", "DoctorReport", "run_doctor"]
