"""Device side of a step: batch description, model execution, sampling."""
