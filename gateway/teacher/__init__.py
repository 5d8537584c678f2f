"""A policy's teacher: its finished samples scored by a teacher pool before delivery (on-policy distillation)."""

from gateway.teacher.queue import ScoringQueue
from gateway.teacher.scoring import TeacherPool, TeacherScoring, teacher_fields

__all__ = ["ScoringQueue", "TeacherPool", "TeacherScoring", "teacher_fields"]
