"""The API's refusals: status and ``{"error": {message, type, param, code}}``
bodies, worded as OpenAI's API words them where that is known (see
docs/emulator.md for where each wording comes from). The other APIs' modules
(anthropic.py, gemini.py) raise the same ``APIError`` with their own bodies."""

from __future__ import annotations

NOT_PERSISTED_HINT = (" Items are not persisted when `store` is set to false. Try again with `store` set to true,"
                      " or remove this item from your input.")
SERVER_ERROR_MESSAGE = "The server had an error while processing your request. Sorry about that!"
# What an ``error`` event carries when a stream fails after it started.
STREAM_ERROR = {"type": "server_error", "code": "server_error", "message": SERVER_ERROR_MESSAGE, "param": None}


class APIError(Exception):
    """A refusal: its status and body. The body is OpenAI's unless another
    API's is given; every API's body has its details under ``error`` (a
    server's routing answer, ``method_not_allowed``, is no API's)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str] = {}  # sent with it (an error event carries them as an object)
        self.body = body if body is not None else {
            "error": {"message": message, "type": type_, "param": param, "code": code}}


def missing_api_key() -> APIError:
    return APIError(401, "You didn't provide an API key. You need to provide your API key in an Authorization header"
                         " using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with"
                         " blank username) if you're accessing the API from your browser and are prompted for a"
                         " username. You can obtain an API key from https://platform.openai.com/account/api-keys.")


def unparsable_json() -> APIError:
    return APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you aren't using"
                         " your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was"
                         " not valid JSON.)")


def missing_parameter(param: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def missing_model() -> APIError:
    return missing_parameter("model")


def unknown_parameter(param: str) -> APIError:
    """What the API answers a field it does not know."""
    return APIError(400, f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")


def invalid_type(param: str, expected: str, value: object) -> APIError:
    return APIError(400, f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
                    param=param, code="invalid_type")


def _json_type(value: object) -> str:
    """A JSON value's type as the API's messages name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def array_too_long(param: str, maximum: int, length: int) -> APIError:
    return APIError(400, f"Invalid '{param}': array too long. Expected an array with maximum length {maximum},"
                         f" but got an array with length {length} instead.", param=param, code="array_above_max_length")


def too_many_properties(param: str, maximum: int, count: int) -> APIError:
    return APIError(400, f"Invalid '{param}': too many properties. Expected an object with at most {maximum}"
                         f" properties, but got an object with {count} properties instead.",
                    param=param, code="object_above_max_properties")


def string_too_long(param: str, maximum: int, length: int) -> APIError:
    return APIError(400, f"Invalid '{param}': string too long. Expected a string with maximum length {maximum},"
                         f" but got a string with length {length} instead.", param=param,
                    code="string_above_max_length")


def key_too_long(param: str, maximum: int, length: int) -> APIError:
    return APIError(400, f"Invalid '{param}': key too long. Expected a key with maximum length {maximum},"
                         f" but got a key with length {length} instead.", param=param, code="key_above_max_length")


def invalid_input_type() -> APIError:
    return APIError(400, "Invalid type for 'input': expected one of a string or array of input items.",
                    param="input", code="invalid_type")


def previous_response_not_found(response_id: object) -> APIError:
    return APIError(400, f"Previous response with id '{response_id}' not found.",
                    param="previous_response_id", code="previous_response_not_found")


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.")


def item_not_found(item_id: object, param: str = "input", request_store: bool = True) -> APIError:
    """An item reference (or a list cursor) naming no stored item; the API adds
    a hint when the request itself was sent with ``store: false``."""
    hint = "" if request_store else NOT_PERSISTED_HINT
    return APIError(404, f"Item with id '{item_id}' not found.{hint}", param=param)


def conversation_not_found(conversation_id: object) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.")


def conversation_with_previous_response() -> APIError:
    """``conversation`` and ``previous_response_id`` together, worded (names cut
    short) as public captures of the live API record it (docs/emulator.md names
    them; OpenAI's documentation and SDK give no wording)."""
    return APIError(400, "Mutually exclusive parameters: ''. Ensure you are only providing one of: 'pre..._id' or"
                         " 'conversation'.", code="mutually_exclusive_parameters")


def no_item_found(item_id: object, param: str | None = None) -> APIError:
    """The Conversations API's own wording for an item id it does not hold."""
    return APIError(404, f"No item found with id '{item_id}'", param=param)


def item_already_in_conversation() -> APIError:
    return APIError(400, "Item already in conversation", param="items", code="item_already_in_conversation")


def duplicate_item(item_id: str) -> APIError:
    """An input item whose id is already in the conversation, or twice in the input (public captures of the live
    API record this wording; docs/emulator.md names them)."""
    return APIError(400, f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try"
                         " again.", param="input")


def invalid_item() -> APIError:
    """A conversation item the API cannot keep (a reasoning item with neither id nor encrypted content)."""
    return APIError(400, "Invalid item", param="item", code="invalid_item")


def not_cancellable() -> APIError:
    return APIError(400, "Cannot cancel a synchronous response.")


def invalid_limit(value: str) -> APIError:
    try:
        number = int(value)
    except ValueError:
        return APIError(400, f"Invalid 'limit': expected an integer, but got '{value}' instead.",
                        param="limit", code="invalid_type")
    if number < 1:
        return APIError(400, f"Invalid 'limit': integer below minimum value. Expected a value >= 1, but got"
                             f" {number} instead.", param="limit", code="integer_below_min_value")
    return APIError(400, f"Invalid 'limit': integer above maximum value. Expected a value <= 100, but got"
                         f" {number} instead.", param="limit", code="integer_above_max_value")


def invalid_order(value: str) -> APIError:
    return APIError(400, f"Invalid value: '{value}'. Supported values are: 'asc' and 'desc'.",
                    param="order", code="invalid_value")


def invalid_url(method: str, path: str) -> APIError:
    return APIError(404, f"Invalid URL ({method} {path})")


def method_not_allowed() -> APIError:
    """A path a server routes for other methods only, as FastAPI answers it:
    no OpenAI body (nothing under ``error``)."""
    return APIError(405, "Method Not Allowed", body={"detail": "Method Not Allowed"})


def server_error(status: int = 500) -> APIError:
    return APIError(status, SERVER_ERROR_MESSAGE, "server_error")


def injected(fault: dict) -> APIError:
    """The error a fault asks for (``status``, ``code``, ``message``, ``type``,
    ``headers``: the HTTP headers an error event carries, ``Retry-After``):
    by default a server error from 500 up, otherwise a refused request."""
    status = fault.get("status", 500)
    if status >= 500:
        error = APIError(status, fault.get("message", SERVER_ERROR_MESSAGE), fault.get("type", "server_error"),
                         code=fault.get("code"))
    else:
        error = APIError(status, fault.get("message", "The request was refused."),
                         fault.get("type", "invalid_request_error"), code=fault.get("code"))
    error.headers = dict(fault.get("headers") or {})
    return error


# -- WebSocket mode: each refusal is an ``error`` event on the socket -----------

def websocket_connection_limit_reached() -> APIError:
    """A socket past its lifetime; worded as OpenAI's API words it (codex-rs
    ``responses_websocket.rs`` matches this code and message)."""
    return APIError(400, "Responses websocket connection limit reached (60 minutes). Create a new websocket"
                         " connection to continue.", code="websocket_connection_limit_reached")


def response_in_progress(response_id: str, code: str = "conversation_already_has_active_response") -> APIError:
    """A ``response.create`` while its lane's turn runs. The wording is the
    Realtime API's for the same refusal; the Responses API's is not published."""
    return APIError(400, f"Conversation already has an active response in progress: {response_id}. Wait until the"
                         " response is finished before creating a new one.", code=code)


def background_unsupported() -> APIError:
    """vLLM's answer to ``background: true`` without its response store (serving.py)."""
    return APIError(400, "This vLLM engine does not support `store=True` and therefore does not support the "
                         "background mode. To enable these features, set the environment variable "
                         "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.", param="background")


def background_over_websocket() -> APIError:
    return APIError(400, "Unsupported parameter: 'background' is not supported in WebSocket mode.",
                    param="background", code="unsupported_parameter")


def unknown_client_event(event_type: object) -> APIError:
    return APIError(400, f"Invalid value: '{event_type}'. Supported values are: 'response.create'.",
                    param="type", code="invalid_value")
