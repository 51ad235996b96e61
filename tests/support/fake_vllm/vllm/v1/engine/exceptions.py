class EngineDeadError(Exception):
    pass


class EngineGenerateError(Exception):
    pass
