"""The doctor: the standalone wiring test (accuracy in isolation, layout sweep, capture
drift, alignment, predicted vs measured acceptance, serving lint) as a product."""

from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.doctor_command import run_doctor

__all__ = ["Check", "DoctorConfig", "DoctorReport", "run_doctor"]
