"""The HTTP frontend's endpoints other than inference: health, server metadata, the logging
and trace settings, statistics, the model repository, and the registration of shared memory."""
from __future__ import annotations

import base64
import binascii

from .._errors import InvalidArgumentError, UnavailableError, UnsupportedError
from .._repo_manager import NOT_EXPLICIT
from ._http1_messages import Request, Response
from ._http_json import _dict, _json_body, _method_not_allowed, json_response
from ._tensor_decode import is_uint
from .dataplane import DataPlane


class _Endpoints:
    """The endpoints of :class:`.http.HTTPFrontend` other than inference, each answering a
    request its router matched (a mixin: they use the frontend's plane)."""

    plane: DataPlane  # (set by HTTPFrontend.__init__)

    # -- server ------------------------------------------------------------------------------

    async def _health(self, request: Request, kind: str) -> Response:
        if request.method != "GET":
            return _method_not_allowed("text/plain")
        ok = self.plane.live() if kind == "live" else await self.plane.ready()
        return Response(200 if ok else 400, content_type="text/plain")  # as Triton, empty

    async def _server_metadata(self, request: Request) -> Response:
        if request.method != "GET":
            return _method_not_allowed()
        return json_response(self.plane.server_metadata())

    async def _logging(self, request: Request) -> Response:
        if request.method == "GET":
            return json_response(self.plane.log_settings.get())
        if request.method == "POST":
            body = request.body
            if not body.strip(b" \t\r\n"):
                # As Triton 2.51: a settings update needs a JSON document; an empty body (or one
                # of whitespace only) changes nothing and is refused in its JSON parser's words
                # (Triton answers 500; a bad request body is 400 here, as everywhere).
                raise InvalidArgumentError("failed to parse the request JSON buffer: The "
                                           f"document is empty. at {len(body)}")
            return json_response(self.plane.update_log_settings(_json_body(request)))
        return _method_not_allowed()

    async def _trace(self, request: Request, model: str = "") -> Response:
        if request.method == "GET":
            return json_response(self.plane.trace_settings(None, model))
        if request.method == "POST":
            return json_response(self.plane.trace_settings(_json_body(request), model))
        return _method_not_allowed()

    async def _stats(self, request: Request, name: str, version: str) -> Response:
        if request.method != "GET":
            return _method_not_allowed()
        return json_response(await self.plane.statistics(name, version))

    # -- repository --------------------------------------------------------------------------

    async def _repository(self, request: Request, repo: str, kind: str, name: str | None,
                          action: str | None) -> Response:
        if request.method != "POST":
            return _method_not_allowed()
        if repo and kind != "index":  # Triton 2.51 answers the index whatever the name
            raise UnsupportedError("'repository_name' specification is not supported")
        if action == "unload" and self.plane.server.model_control_mode != "explicit":
            # As Triton 2.51 (measured; QA L0_http): an unload is refused for the mode before
            # its body is read (a load's body is read first).
            raise UnavailableError(NOT_EXPLICIT)
        body = _json_body(request)
        if kind == "index":
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgumentError("Unable to parse 'ready'")
            # As Triton's JSON: a field with nothing to say (a READY model's reason) is left out.
            index = await self.plane.repository_index(ready)
            return json_response([{k: v for k, v in m.items() if v != ""} for m in index])
        assert name is not None
        params = _dict(body.get("parameters"), "parameters")
        if action == "load":
            config: str | None = None
            files: dict[str, bytes] = {}
            for key, value in params.items():
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"Unable to parse parameter '{key}': expected a string")
                if key == "config":
                    config = value
                elif key.startswith("file:"):
                    try:
                        files[key] = base64.b64decode(value, validate=True)
                    except (binascii.Error, ValueError):
                        raise InvalidArgumentError(f"parameter '{key}' is not valid base64") from None
                else:
                    raise InvalidArgumentError(f"unexpected parameter '{key}' in load request")
            await self.plane.load(name, config, files or None)
        else:
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidArgumentError("Unable to parse 'unload_dependents'")
            await self.plane.unload(name, dependents)
        return Response(200, content_type="application/json")

    # -- shared memory -----------------------------------------------------------------------

    def _shm_method_ok(self, request: Request, action: str) -> bool:
        return request.method == ("GET" if action == "status" else "POST")

    async def _system_shm(self, request: Request, region: str, action: str) -> Response:
        if not self._shm_method_ok(request, action):
            return _method_not_allowed()
        shm = self.plane.shm
        if action == "status":
            return json_response(shm.status(region))
        if action == "register":
            if not region:
                raise InvalidArgumentError(
                    "'region name' is necessary to register system shared memory region"
                )
            body = _json_body(request, required=True)
            if "key" not in body:
                raise InvalidArgumentError("Shared memory register request has no 'key' field")
            if "byte_size" not in body:
                raise InvalidArgumentError("Shared memory register request has no 'byte_size' field")
            key, offset, size = body["key"], body.get("offset", 0), body["byte_size"]
            if not isinstance(key, str):
                raise InvalidArgumentError("Unable to parse 'key'")
            if not is_uint(offset) or not is_uint(size):
                raise InvalidArgumentError("Unable to parse 'offset' or 'byte_size'")
            shm.register(region, key, offset, size)
        else:
            shm.unregister(region)
        return Response(200, content_type="application/json")

    async def _cuda_shm(self, request: Request, region: str, action: str) -> Response:
        # Without GPUs (none counted), as a Triton built without GPU support: status lists
        # nothing, unregister has nothing to do, register is refused.
        if not self._shm_method_ok(request, action):
            return _method_not_allowed()
        shm = self.plane.shm
        if action == "status":
            return json_response(shm.cuda_status(region))
        if action == "register":
            shm.require_gpus(region)
            body = _json_body(request, required=True)
            for field in ("raw_handle", "device_id", "byte_size"):
                if field not in body:
                    raise InvalidArgumentError(
                        f"CUDA shared memory register request has no '{field}' field")
            raw = body["raw_handle"]
            b64 = raw.get("b64") if isinstance(raw, dict) else None
            if not isinstance(b64, str):
                raise InvalidArgumentError("Unable to parse 'raw_handle': expected {\"b64\": ...}")
            try:
                handle = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgumentError("Unable to parse 'raw_handle': not base64") from None
            device, size = body["device_id"], body["byte_size"]
            if not is_uint(device) or not is_uint(size):
                raise InvalidArgumentError("Unable to parse 'device_id' or 'byte_size'")
            shm.register_cuda(region, handle, device, size)
        else:
            shm.unregister_cuda(region)
        return Response(200, content_type="application/json")

